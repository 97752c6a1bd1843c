"""Load a Hugging Face causal LM and its tokenizer, with errors a user can act on.

`--model` is a local folder, a hub id, or a `.gguf` file (loaded with transformers' GGUF
support, `gguf_file=`: the weights are dequantized to a float dtype; needs the `gguf`
extra: `pip install "kvtool[gguf]"`).
"""

import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from kvtool.context_limit import DEFAULT_MODEL_DIR, DEFAULT_MODEL_ENV
from kvtool.errors import ModelError
from kvtool.hub import check_hub_reachable
from kvtool.models.adapter import TESTED_FAMILIES, adapter_for, refusal_reason
from kvtool.quiet import quiet_progress_bars

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

_LOAD_HINT = "pass a local directory with config.json and weights, or a hub id reachable from this machine"


def resolve_model_path(model: str | None) -> str:
    """Where to load from: a local directory or .gguf file (absolute path) or a hub id passed through.

    None -> DEFAULT_MODEL_DIR if it exists, else $KVTOOL_DEFAULT_MODEL, else ModelError.
    A string that looks like a path (absolute, ./, ../, ~) must be an existing directory or .gguf file.
    """
    if model is None:
        return _default_model_path()
    path = Path(model).expanduser()
    if path.is_dir() or (path.is_file() and _is_gguf(path)):
        return str(path.resolve())
    if path.exists():
        raise ModelError(
            f"model path '{model}' is a file but not a .gguf file; pass the directory holding config.json and "
            "weights, or a .gguf file"
        )
    if _looks_like_path(model):
        raise ModelError(f"model directory '{model}' does not exist; {_LOAD_HINT}")
    check_hub_reachable(model)
    return model  # a hub id, e.g. "meta-llama/Llama-3.2-1B"


def load_model(
    model: str | None = None,
    *,
    dtype: str = "auto",
    device: str = "cpu",
    device_map: str | None = None,
    tokenizer: bool = True,
    max_memory: dict | None = None,
    offload_folder: str | None = None,
) -> tuple:
    """Load (model, tokenizer) in eval mode; the tokenizer pads on the left and has a pad token.

    tokenizer=False loads no tokenizer and returns (model, None), for models that work on
    token ids only (e.g. `kvtool.eval.copy_model`), whose folders hold no tokenizer files.

    dtype: "auto" (float32 on CPU; the checkpoint's dtype, or bfloat16, on CUDA),
    "float32", "float16" or "bfloat16". device: "cpu", "cuda", "cuda:N", ... ;
    device_map (e.g. "auto") is passed to from_pretrained instead of moving to `device`.
    max_memory ({"cpu": "2GiB", 0: "20GiB"}, see `kvtool.models.offload.parse_max_memory`)
    caps what each device holds (it implies device_map="auto"); the rest is offloaded to
    disk, read back from the checkpoint's safetensors or from offload_folder.
    Raises ModelError for a missing model, an unsupported family or an unavailable device.
    """
    path = resolve_model_path(model)
    _check_device(device)
    source = _source(path)
    config = _load_config(path, source)
    if max_memory is not None and device_map is None:
        device_map = "auto"  # a memory cap means: place what fits, offload the rest
    on_cpu = torch.device(device).type == "cpu" and (device_map is None or not torch.cuda.is_available())
    torch_dtype = _resolve_dtype(dtype, config, on_cpu)
    offload = {k: v for k, v in (("max_memory", max_memory), ("offload_folder", offload_folder)) if v is not None}
    try:
        with quiet_progress_bars():
            loaded = AutoModelForCausalLM.from_pretrained(
                source["where"], config=config, dtype=torch_dtype, device_map=device_map, **source["kwargs"], **offload
            )
    except Exception as exc:
        raise ModelError(f"could not load model '{path}': {exc}; {_LOAD_HINT}") from exc
    if device_map is None:
        loaded = loaded.to(device)
    loaded.eval()
    adapter = adapter_for(loaded)  # fail early if the layout is not what the adapter expects
    if adapter.geometry.family not in TESTED_FAMILIES:
        from kvtool.models.verify import verify_adapter

        verify_adapter(loaded, adapter)  # the generic reading of an untested family, checked on a short forward
    return loaded, (load_tokenizer(path) if tokenizer else None)


def load_tokenizer(path: str):
    """The model's tokenizer with padding_side="left" and pad_token (eos if it had none)."""
    source = _source(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source["where"], **source["kwargs"])
    except Exception as exc:
        raise ModelError(
            f"could not load the tokenizer of '{path}': {exc}; the model directory needs its "
            "tokenizer files (tokenizer.json or tokenizer.model, and tokenizer_config.json)"
        ) from exc
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelError(f"the tokenizer of '{path}' has neither a pad token nor an eos token; add one to its tokenizer_config.json")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def _default_model_path() -> str:
    """DEFAULT_MODEL_DIR, else $KVTOOL_DEFAULT_MODEL, else ModelError."""
    if DEFAULT_MODEL_DIR.is_dir():
        return str(DEFAULT_MODEL_DIR)
    from_env = os.environ.get(DEFAULT_MODEL_ENV)
    if from_env:
        return resolve_model_path(from_env)
    raise ModelError(
        f"no model given and no default model: {DEFAULT_MODEL_DIR} does not exist and "
        f"${DEFAULT_MODEL_ENV} is not set; pass --model or set ${DEFAULT_MODEL_ENV} to a model directory"
    )


def _is_gguf(path: Path) -> bool:
    return path.suffix.lower() == ".gguf"


def _source(path: str) -> dict:
    """from_pretrained arguments: {"where": folder or hub id, "kwargs": {"gguf_file": name} for a .gguf file}."""
    file = Path(path)
    if not _is_gguf(file):
        return {"where": path, "kwargs": {}}
    for package in ("gguf", "accelerate"):
        try:
            __import__(package)
        except ImportError as exc:
            raise ModelError(
                f"loading '{path}' needs the '{package}' package, which is not installed; "
                'install the GGUF extra: pip install "kvtool[gguf]"'
            ) from exc
    return {"where": str(file.parent), "kwargs": {"gguf_file": file.name}}


def _looks_like_path(model: str) -> bool:
    """True for absolute paths and ./ ../ ~ forms (hub ids are 'name' or 'org/name')."""
    return os.path.isabs(model) or model.startswith((".", "~")) or model.count("/") > 1


def _check_device(device: str) -> None:
    """ModelError if the device is malformed or its backend is not available."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as exc:
        raise ModelError(f"unknown device '{device}'; use 'cpu', 'cuda' or 'cuda:N'") from exc
    if kind == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"device '{device}' requested but CUDA is not available on this machine; use device 'cpu'")


def _load_config(path: str, source: dict):
    """The model config, checked (refused architectures, e.g. MLA) before any weights load."""
    try:
        config = AutoConfig.from_pretrained(source["where"], **source["kwargs"])
    except Exception as exc:
        raise ModelError(f"could not load model '{path}': {exc}; {_LOAD_HINT}") from exc
    reason = refusal_reason(config)
    if reason:
        raise ModelError(f"model '{path}': {reason}")
    return config


def _resolve_dtype(dtype: str, config, on_cpu: bool) -> torch.dtype:
    """Map a dtype name to a torch dtype; "auto" is float32 on CPU, the checkpoint's (or bf16) elsewhere."""
    if dtype == "auto":
        if on_cpu:
            return torch.float32
        checkpoint_dtype = getattr(config, "dtype", None)
        return checkpoint_dtype if isinstance(checkpoint_dtype, torch.dtype) else torch.bfloat16
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype '{dtype}'; use one of: auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]
