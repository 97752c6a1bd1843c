"""benchmarks/peers_passkey.py without kvpress: the question-agnostic split of the peers' loop.

Question-aware, the whole prompt is prefilled under the press; question-agnostic, only the context
(all but the task's question tokens) is, and the question follows at its true positions. With no
press (the full cache) both give the same greedy continuation.
"""

import contextlib

import torch

from benchmarks.peers_passkey import press_accuracy
from kvtool.eval.retrieval_request import RetrievalGrid
from kvtool.models.cache_argument import CACHE_ARGUMENTS
from tests.tiny_models import tiny_model


class FakeTask:
    """Random prompts; records what was generated and scores every row a hit."""

    new_tokens, question = 3, 5

    def __init__(self) -> None:
        self.generated = []

    def cases(self, n: int, depth: float, seeds: int):
        gen = torch.Generator().manual_seed(int(depth * 100))
        return torch.randint(3, 100, (seeds, n), generator=gen), [None] * seeds

    def question_tokens(self, n: int, seeds: int) -> int:
        return self.question

    def score(self, generated: torch.Tensor, answers) -> list[bool]:
        self.generated.append(generated)
        return [True] * generated.shape[0]


class RecordingPress:
    """A press that compresses nothing and records the length of every forward made under it."""

    def __init__(self) -> None:
        self.lengths = []

    @contextlib.contextmanager
    def __call__(self, model):
        hook = model.register_forward_pre_hook(lambda module, args, kwargs: self.lengths.append(kwargs["input_ids"].shape[1]),
                                               with_kwargs=True)
        try:
            yield
        finally:
            hook.remove()


def test_question_agnostic_prefills_only_the_context_under_the_press():
    model, grid = tiny_model("llama"), RetrievalGrid((40,), (0.0, 0.5), 2)
    for agnostic, expected in ((False, 40), (True, 40 - FakeTask.question)):
        press = RecordingPress()
        result = press_accuracy(model, FakeTask(), press, grid, question_agnostic=agnostic)
        assert press.lengths == [expected, expected]  # one forward per cell under the press
        assert result["accuracy"] == 1.0


def test_question_agnostic_full_cache_generates_what_the_aware_one_does():
    model, grid = tiny_model("llama"), RetrievalGrid((40,), (0.0, 0.5), 2)
    aware, agnostic = FakeTask(), FakeTask()
    press_accuracy(model, aware, None, grid)
    press_accuracy(model, agnostic, None, grid, question_agnostic=True)
    for a, b in zip(aware.generated, agnostic.generated):
        assert torch.equal(a, b)


def test_multi_fact_runs_are_named_apart_and_the_task_asks_one_of_k_keys():
    """``--facts K``: its own JSON (a multi-fact run never overwrites a pass-key one), and prompts that hold K keys."""
    from benchmarks.peers_passkey import parse_args, result_name
    from kvtool.eval.retrieval_tasks import PasskeyTask

    assert result_name(parse_args(["--side", "kvtool"])) == "peers_passkey_smollm2-135m_kvtool"
    args = parse_args(["--side", "kvtool", "--model", "gemma3-270m", "--length", "1024", "--facts", "4", "--tag", "x"])
    assert args.facts == 4 and result_name(args) == "peers_passkey_gemma3-270m_kvtool_1024_facts4_x"
    assert result_name(parse_args(["--question-agnostic", "--facts", "2"])) == "peers_passkey_smollm2-135m_peers_agnostic_facts2"

    class Chars:  # a character tokenizer: enough to count the keys in a prompt
        bos_token_id = None

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [ord(c) for c in text]}

        def convert_ids_to_tokens(self, ids):
            return [chr(i) for i in ids]

        def convert_tokens_to_string(self, tokens):
            return "".join(tokens)

    filler = lambda count, seed: torch.tensor([ord(c) for c in ("Some filler text. " * 100)[:count]])  # noqa: E731
    prompts, answers = PasskeyTask(Chars(), filler, facts=4).cases(600, 0.5, 2)
    for prompt, answer in zip(prompts, answers):
        text = "".join(map(chr, prompt.tolist()))
        assert text.count("Remember it.") == 4 and answer in text and text.rstrip().endswith("is")


class UnevenPress:
    """A press that drops the oldest ``drop`` tokens of layer 1 only (layers of one kind left unequal, as PyramidKV's)."""

    def __init__(self, drop: int = 3) -> None:
        self.drop = drop

    @contextlib.contextmanager
    def __call__(self, model):
        def trim(module, args, kwargs, output):
            layer = next(kwargs[name] for name in CACHE_ARGUMENTS if name in kwargs).layers[1]
            layer.keys, layer.values = layer.keys[..., self.drop:, :], layer.values[..., self.drop:, :]

        hook = model.register_forward_hook(trim, with_kwargs=True)
        try:
            yield
        finally:
            hook.remove()


class CountingPress(UnevenPress):
    """UnevenPress, counting the tokens of every forward of the model (under the press or not)."""

    def __init__(self, model, drop: int) -> None:
        super().__init__(drop)
        self.lengths = []
        model.register_forward_pre_hook(lambda module, args, kwargs: self.lengths.append(kwargs["input_ids"].shape[1]),
                                        with_kwargs=True)


def test_question_after_uneven_layers_is_fed_one_token_per_forward():
    q, new = FakeTask.question, FakeTask.new_tokens
    for drop, question_forwards in ((0, [q]), (3, [1] * q)):  # equal layers: one forward, as before; uneven: one per token
        model, grid = tiny_model("llama"), RetrievalGrid((40,), (0.0,), 2)
        task, press = FakeTask(), None
        press = CountingPress(model, drop)
        result = press_accuracy(model, task, press, grid, question_agnostic=True)  # one forward fails when uneven
        assert press.lengths == [40 - q, *question_forwards, *[1] * (new - 1)]
        assert result["accuracy"] == 1.0 and task.generated[0].shape == (2, new)


def test_kvtool_methods_take_recipes_and_benchmark_variants_at_the_fraction():
    """``--methods knorm`` (a benchmarks.eviction variant, no bundled recipe) runs; a bundled recipe keeps its own
    settings at the asked fraction; an unknown name stops with the names it knows."""
    import pytest

    from benchmarks.peers_passkey import _kvtool_recipe

    knorm = _kvtool_recipe("knorm", 0.25)
    assert knorm.eviction.policy == "knorm" and knorm.eviction.budget == 0.25
    snapkv = _kvtool_recipe("snapkv", 0.125)
    assert snapkv.eviction.policy == "snapkv" and snapkv.eviction.budget == 0.125 and snapkv.eviction.pooling == 7
    with pytest.raises(SystemExit, match="vatp"):
        _kvtool_recipe("no-such-policy", 0.5)
