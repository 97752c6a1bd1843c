"""Rich rendering of kvtool results for the terminal (used only by `kvtool.cli`)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvtool.errors import RuntimeConfigError


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def read_prompts(prompts: list[str] | None, prompt_file: Path | None) -> list[str]:
    """--prompt values plus the text of --prompt-file; at least one."""
    out = list(prompts or [])
    if prompt_file is not None:
        if not prompt_file.is_file():
            raise RuntimeConfigError(f"prompt file '{prompt_file}' does not exist")
        text = prompt_file.read_text()
        if not text.strip():
            raise RuntimeConfigError(f"prompt file '{prompt_file}' is empty")
        out.append(text)
    if not out:
        raise RuntimeConfigError("give a prompt: --prompt TEXT (repeatable) or --prompt-file FILE")
    return out


def render_memory(console: Console, memory: dict, seconds_note: str = "") -> None:
    """Bytes held against the 16-bit cache (the baseline), the model-dtype cache where it differs, eviction, notes."""
    baseline = memory.get("baseline", "16-bit cache")
    backend = f" ({memory['backend']} backend)" if memory.get("backend") else ""
    table = Table(title=f"KV cache{backend}", show_header=True,
                  caption="held: bytes of the tensors in use; reserved: bytes the block pools have allocated")
    columns = ["tokens x batch", "held", "reserved", baseline, "ratio", "bits/element"]
    if "model_dtype_cache_bytes" in memory:
        columns.append(f"{memory['model_dtype']} (model dtype)")
    for column in columns:
        table.add_column(column, justify="right")
    table.add_row(
        f"{memory['tokens']} x {memory['batch']}", _mib(memory["cache_bytes"]),
        _mib(memory.get("reserved_bytes", memory["cache_bytes"])), _mib(memory["fp16_cache_bytes"]),
        f"{memory['compression_ratio']:.2f}x", f"{memory['bits_per_element']:.2f}",
        *((_mib(memory["model_dtype_cache_bytes"]),) if "model_dtype_cache_bytes" in memory else ()),
    )
    console.print(table)
    if "policy" in memory:
        console.print(f"eviction ({memory['policy']}): {memory['kept_tokens']} tokens held over all layers, sequences and "
                      f"KV heads = {100 * memory['kept_fraction']:.1f}% of the tokens seen")
    if "sparse_read_fraction" in memory:
        console.print(f"sparse attention: decode steps read {100 * memory['sparse_read_fraction']:.1f}% of the tokens held; "
                      f"their key summaries take {_mib(memory['key_summary_bytes'])} of the cache"
                      + (f", the key and value sums of what they do not read {_mib(memory['token_sum_bytes'])}"
                         if "token_sum_bytes" in memory else ""))
    if seconds_note:
        console.print(seconds_note)
    render_notes(console, memory)


def render_generation(console: Console, prompts: list[str], result, streamed: bool) -> None:
    if streamed:
        console.print()
    else:
        for prompt, text in zip(prompts, result.texts):
            console.print(f"[dim]{escape(prompt)}[/]{escape(text)}", highlight=False)
            console.rule()
    timing = getattr(result, "timing", {}) or {}
    speed = f"{result.new_tokens} new tokens x {len(prompts)} in {result.seconds:.2f} s = {result.tokens_per_s:.1f} tokens/s"
    if timing.get("decode_steps"):
        speed += (f" (decode steps: median {timing['decode_tokens_per_s_median']:.1f}, best "
                  f"{timing['decode_tokens_per_s_best']:.1f} tokens/s over {timing['decode_steps']} steps)")
    render_memory(console, result.memory, speed)
    render_notes(console, timing)


def _speed(report: dict, prefix: str = "") -> str:
    """'median / best' decode tokens/s (the mean where only that was measured)."""
    median = report.get(f"{prefix}decode_tokens_per_s_median")
    if median is None:
        return f"{report[f'{prefix}decode_tokens_per_s']:.1f}"
    return f"{median:.1f} / {report[f'{prefix}decode_tokens_per_s_best']:.1f}"


def render_notes(console: Console, report: dict) -> None:
    """The report's caveats (nothing compressed yet, baseline at chance, noisy timings), one line each."""
    for key in ("note", "speed_note"):
        if report.get(key):
            console.print(f"[yellow]note:[/] {escape(report[key])}", highlight=False)


def _interval(report: dict) -> str:
    """The paired 95% interval of ``delta_pct`` (`kvtool.eval.paired_delta`) as text."""
    low, high = report["delta_ci95_pct"]
    return f"{low:+.2f} .. {high:+.2f}%"


def render_perplexity(console: Console, report: dict | list[dict]) -> None:
    """One column per cache: the 16-bit baseline, the model-dtype cache where it differs, then the runtime's cache (or
    each of several, scored on the same windows: a list of reports sharing their baseline rows)."""
    reports = report if isinstance(report, list) else [report]
    first = reports[0]
    baseline = first.get("baseline", "16-bit cache")
    short = baseline.removesuffix(" cache")
    fp16 = first["fp16_cache_bytes"]
    caches = []  # (header, report, key prefix, delta)
    if "baseline_ppl" in first:
        caches.append((f"{short} (baseline)", first, "baseline_", None))
    dtype_row = next((r for r in reports if "model_dtype_ppl" in r), None)
    if dtype_row is not None and len(reports) == 1:  # several caches: a line under the table (the width is theirs)
        caches.append((f"{dtype_row['model_dtype']} (model dtype)", dtype_row, "model_dtype_", dtype_row["model_dtype_delta_pct"]))
    caches += [(r["recipe"], r, "", r.get("delta_pct")) for r in reports]
    steps = first.get("decode_steps")
    table = Table(title=f"Perplexity through the runtime ({first['scored_tokens']} scored tokens)",
                  caption=f"decode tokens/s: median / best of {steps} steps" if steps else None)
    table.add_column("", no_wrap=True)  # row names whole; the caches' columns wrap instead
    for header, _, _, _ in caches:  # narrow columns fold their text rather than cut it
        table.add_column(header, justify="right", overflow="fold")
    kept = any(r.get("kept_fraction", 1.0) < 1.0 for r in reports)
    sparse = any(r.get("sparse_read_fraction", 1.0) < 1.0 for r in reports)
    rows = [
        ("perplexity", [f"{r[p + 'ppl']:.3f}" for _, r, p, _ in caches]),
        (f"delta vs {short}", ["" if d is None else f"{d:+.2f}%" for _, _, _, d in caches]),
        *((("delta 95% interval", ["" if p or not r.get("delta_ci95_pct") else _interval(r) for _, r, p, _ in caches]),)
          if any(r.get("delta_ci95_pct") for r in reports) else ()),
        *((("kept", [f"{100 * (1.0 if p else r.get('kept_fraction', 1.0)):.1f}%" for _, r, p, _ in caches]),)
          if kept else ()),
        *((("tokens read per step", [f"{100 * (1.0 if p else r.get('sparse_read_fraction', 1.0)):.1f}%" for _, r, p, _ in caches]),)
          if sparse else ()),
        ("bits per element", [f"{_bits(r, p, fp16):.2f}" for _, r, p, _ in caches]),
        ("bytes per token", [f"{r[p + 'bytes_per_token']:.0f}" for _, r, p, _ in caches]),
        ("cache held", [_mib(r[p + "cache_bytes"]) for _, r, p, _ in caches]),
        ("cache reserved", [_mib(r.get(p + "reserved_cache_bytes", r[p + "cache_bytes"])) for _, r, p, _ in caches]),
        (f"size vs {short}", [f"{fp16 / r[p + 'cache_bytes']:.2f}x" for _, r, p, _ in caches]),
        *(((f"held vs {short}, mean of steps", [_held(r, p) for _, r, p, _ in caches]),)
          if any(r.get("held_fraction_mean") is not None for r in reports) else ()),
        ("decode tokens/s", [_speed(r, p) for _, r, p, _ in caches]),
    ]
    for label, cells in rows:
        table.add_row(label, *cells)
    console.print(table)
    mode = "true decoding (1 token per step)" if first["exact_decoding"] else f"APPROXIMATE: chunks of {first['chunk']} tokens see each other uncompressed"
    backends = sorted({r["backend"] for r in reports if r.get("backend")})
    backend = f"; {', '.join(backends)} backend" if backends else ""
    console.print(f"{first['windows']} windows x {first['seq_len']} tokens, prefill {first['prefill']}; {mode}{backend}")
    if dtype_row is not None and len(reports) > 1:
        console.print(f"{dtype_row['model_dtype']} (model dtype) cache: perplexity {dtype_row['model_dtype_ppl']:.3f} "
                      f"({dtype_row['model_dtype_delta_pct']:+.2f}% vs {short}), {_mib(dtype_row['model_dtype_cache_bytes'])} held")
    if len(reports) == 1:
        render_notes(console, first)
    else:  # each cache's own caveat, then one speed note for the run
        for r in reports:
            if r.get("note"):
                console.print(f"[yellow]note ({escape(r['recipe'])}):[/] {escape(r['note'])}", highlight=False)
        speed = next((r["speed_note"] for r in reports if r.get("speed_note")), None)
        if speed:
            console.print(f"[yellow]note:[/] {escape(speed)}", highlight=False)


def _held(report: dict, prefix: str) -> str:
    """Bytes held over a 16-bit cache's, averaged over the decode steps (blank in reports from before it was read)."""
    value = report.get(f"{prefix}held_fraction_mean")
    return "" if value is None else f"{100 * value:.1f}%"


def _bits(report: dict, prefix: str, fp16_bytes: float) -> float:
    """Bits per element of a row (older reports carry only bytes for the baseline)."""
    return report.get(f"{prefix}bits_per_element", 16 * report[f"{prefix}cache_bytes"] / fp16_bytes)


def _layer_table(console: Console, tensors: dict, title: str, name_format: str, parts: tuple[str, ...], unit: str) -> None:
    layers = sorted({int(k.split(".")[1]) for k in tensors if k.startswith("layers.")} |
                    {int(k.split(".")[2]) for k in tensors if k.startswith("quality.layers.")})
    table = Table(title=title)
    table.add_column("layer", justify="right")
    for part in parts:
        table.add_column(f"{part} {unit}", justify="right")
    for layer in layers:
        row = []
        for part in parts:
            t = tensors.get(name_format.format(layer=layer, part=part))
            row.append("" if t is None else " ".join(f"{float(v):.1f}" for v in t.reshape(-1)))
        table.add_row(str(layer), *row)
    console.print(table)


_VERDICT = {"under": "[green]yes[/]", "over": "[red]no[/]", "not resolved": "[yellow]not resolved[/]"}


def render_pooled(console: Console, pooled: list[dict]) -> None:
    """`kvtool eval pool`: per recipe, each set's delta and interval, then the pooled row."""
    table = Table(title="Perplexity delta over sets of windows (paired 95% intervals)",
                  caption="held: bytes over a 16-bit cache's, mean of the decode steps")
    target = pooled[0].get("target_pct")
    headers = ["recipe / set", "windows", "held", "delta", "95% interval"]
    if target is not None:
        headers.append(f"<= {target:+g}%?")
    for header in headers:
        table.add_column(header, justify="left" if header == "recipe / set" else "right", overflow="fold")
    for index, row in enumerate(pooled):
        for each in row["set_deltas"]:
            table.add_row(f"  {escape(each['data'])}", str(each["windows"]), "", f"{each['delta_pct']:+.2f}%", _interval(each),
                          *([""] if target is not None else []))
        table.add_row(f"[bold]{escape(row['recipe'])}[/]: {row['sets']} sets", str(row["windows"]), _held(row, ""),
                      f"[bold]{row['delta_pct']:+.2f}%[/]", f"[bold]{_interval(row)}[/]",
                      *([_VERDICT[row["verdict"]]] if target is not None else []), end_section=index < len(pooled) - 1)
    console.print(table)
    console.print(f"{pooled[0]['scored_tokens']} scored tokens in all" if len(pooled) == 1 else
                  "scored tokens: " + ", ".join(f"{row['recipe']} {row['scored_tokens']}" for row in pooled), highlight=False)


def render_profile(console: Console, artifact) -> None:
    table = Table(title="K/V statistics per layer (per KV head)")
    for column in ("layer", "pre-RoPE key absmax", "key token norm", "value absmax", "value token norm"):
        table.add_column(column, justify="right")
    layer = 0
    while f"layers.{layer}.keys.absmax" in artifact.tensors:
        t = artifact.tensors
        fmt = lambda x: " ".join(f"{float(v):.2f}" for v in x.reshape(-1))  # noqa: E731
        table.add_row(str(layer), fmt(t[f"layers.{layer}.keys_pre_rope.absmax"].amax(dim=-1)),
                      fmt(t[f"layers.{layer}.keys.token_norm"]), fmt(t[f"layers.{layer}.values.absmax"].amax(dim=-1)),
                      fmt(t[f"layers.{layer}.values.token_norm"]))
        layer += 1
    console.print(table)
    from kvtool.attention_profile import policy_map

    policies = policy_map(artifact.tensors)
    if policies is not None:
        render_policy_map(console, policies, artifact.manifest.get("fastgen", {}).get("threshold"))


POLICY_STYLES = {"special": "magenta", "punctuation": "yellow", "local": "green", "frequent": "cyan", "full": "red"}


def render_policy_map(console: Console, policies, threshold: float | None = None) -> None:
    """Layer x KV-head table of FastGen policies (coloured), with the layer need and budget weight."""
    from kvtool.methods.evict.fastgen import FASTGEN_POLICIES

    layers, heads = policies.policy.shape
    at = "" if threshold is None else f" at T = {threshold:g}"
    table = Table(title=f"FastGen policy per layer x KV head{at}")
    table.add_column("layer", justify="right")
    for head in range(heads):
        table.add_column(f"head {head}")
    extras = [(name, t) for name, t in (("need", policies.attention_need), ("budget weight", policies.budget_weight))
              if t is not None]
    for name, _ in extras:
        table.add_column(name, justify="right")
    for layer in range(layers):
        names = [FASTGEN_POLICIES[int(p)] for p in policies.policy[layer]]
        cells = [f"[{POLICY_STYLES[n]}]{n}[/]" for n in names]
        table.add_row(str(layer), *cells, *(f"{float(t[layer]):.2f}" for _, t in extras))
    console.print(table)
    expected = policies.expected_cache_fraction
    if expected is not None:
        console.print(f"expected cache fraction {expected:.3f} (tokens kept / tokens seen, mean over layers and KV heads)")


def render_calibration(console: Console, artifact) -> None:
    _layer_table(console, artifact.tensors, "Quantization SQNR per layer (one number per KV head)",
                 "quality.layers.{layer}.{part}.sqnr_db", ("keys", "values"), "dB")
    quality = artifact.manifest.get("quality", {})
    bits = artifact.manifest.get("expected_bits_per_element", {})
    console.print(
        f"mean SQNR keys {quality.get('keys_sqnr_db', float('nan')):.1f} dB, values {quality.get('values_sqnr_db', float('nan')):.1f} dB; "
        f"body {bits.get('body', 0):.2f} bits per element (scales included)"
    )


def render_inspect(console: Console, info: dict) -> None:
    manifest = info["manifest"]
    console.print(f"[bold]{info['path']}[/]: {info['kind']} artifact, kvtool {manifest.get('kvtool_version')}")
    model = manifest.get("model", {})
    console.print(
        f"model: {manifest.get('model_source')} ({model.get('family')}, {model.get('num_layers')} layers, "
        f"{model.get('num_heads')} q heads / {model.get('num_kv_heads')} KV heads, head_dim {model.get('head_dim')}, "
        f"K/V weights sha256 {str(model.get('kv_weights_sha256'))[:16]}...)"
    )
    if "recipe" in manifest:
        render_recipe(console, manifest["recipe"])
    for key in ("calibration", "expected_bits_per_element", "quality", "profile", "fastgen", "pyramid"):
        if key in manifest:
            console.print(f"[bold]{key}[/]: {manifest[key]}", highlight=False)
    table = Table("tensor", "shape", "dtype", title=f"{len(info['tensors'])} tensors")
    for name, meta in sorted(info["tensors"].items()):
        table.add_row(name, str(meta["shape"]), meta["dtype"])
    console.print(table)


def recipe_table(title: str | None = None) -> Table:
    """Columns of `kvtool.recipe_summary.recipe_summary`, after the recipe's name."""
    return Table("recipe", "keys", "values", "float window", "eviction", title=title)


def render_recipe(console: Console, raw: dict) -> None:
    """An artifact's recipe as what it does (method, bits, window, eviction); the raw dict if it does not validate."""
    from kvtool.errors import RecipeError
    from kvtool.recipe import recipe_from_dict
    from kvtool.recipe_summary import recipe_summary

    try:
        recipe = recipe_from_dict(raw)
    except RecipeError:
        console.print(f"[bold]recipe[/]: {raw}", highlight=False)
        return
    table = recipe_table()
    table.add_row(recipe.name, *recipe_summary(recipe).values())
    console.print(table)


def render_summary(console: Console, summary: dict) -> None:
    """`kvtool run`: bits, bytes and speed against the 16-bit cache; perplexity of every row."""
    ppl = summary["perplexity"]
    bits = summary["expected_bits_per_element"]
    baseline = ppl.get("baseline", "16-bit cache")
    backend = f" ({ppl['backend']} backend)" if ppl.get("backend") else ""
    table = Table(title=f"kvtool run: {summary['recipe']['name']}{backend}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    rows = [
        ("body bits per stored element (keys / values)", f"{bits['keys']:.2f} / {bits['values']:.2f}"),
        ("bits per element held (incl. sinks + recent window)", f"{ppl['bits_per_element']:.2f}"),
        (f"cache bytes vs {baseline}", f"{_mib(ppl['cache_bytes'])} vs {_mib(ppl['fp16_cache_bytes'])} "
                                       f"({ppl['fp16_cache_bytes'] / ppl['cache_bytes']:.2f}x smaller)"),
        *((("tokens kept / seen (eviction)", f"{100 * ppl['kept_fraction']:.1f}%"),) if ppl.get("kept_fraction", 1.0) < 1 else ()),
        (f"perplexity {baseline} (baseline)", f"{ppl['baseline_ppl']:.3f}"),
        *(((f"perplexity {ppl['model_dtype']} cache (model dtype)",
            f"{ppl['model_dtype_ppl']:.3f} ({ppl['model_dtype_delta_pct']:+.2f}%)"),) if "model_dtype_ppl" in ppl else ()),
        ("perplexity compressed", f"{ppl['ppl']:.3f} ({ppl['delta_pct']:+.2f}%"
                                  + (f", 95% interval {_interval(ppl)})" if ppl.get("delta_ci95_pct") else ")")),
        (f"decode tokens/s compressed / {baseline} (median; best)",
         f"{_speed(ppl).split(' / ')[0]} / {_speed(ppl, 'baseline_').split(' / ')[0]}"
         + (f" (best {ppl['decode_tokens_per_s_best']:.1f} / {ppl['baseline_decode_tokens_per_s_best']:.1f})"
            if "decode_tokens_per_s_best" in ppl else "")),
    ]
    for row in rows:
        table.add_row(*row)
    console.print(table)
    render_notes(console, ppl)
    sample = summary["sample"]
    console.print(f"[bold]sample[/] [dim]{escape(sample['prompt'])}[/]{escape(sample['text'])}", highlight=False)
    if sample.get("memory", {}).get("note"):
        console.print(f"[yellow]note:[/] sample: {escape(sample['memory']['note'])}", highlight=False)
    console.print(f"files: {summary['files']}")


def render_retrieval(console: Console, report: dict) -> None:
    """Accuracy per (depth, length) cell (baseline in brackets), then the summary."""
    has_base = report.get("baseline_accuracy") is not None
    cells = {(row["depth"], row["n"]): row for row in report["grid"]}
    baseline = report.get("baseline", "16-bit cache")
    table = Table(title=f"{report['task']} retrieval accuracy ({report['seeds']} seeds per cell)",
                  caption=f"(in brackets: the {baseline})" if has_base else None)
    table.add_column("depth", justify="right")
    for n in report["lengths"]:
        table.add_column(f"{n} tokens", justify="right")
    for depth in report["depths"]:
        row = []
        for n in report["lengths"]:
            cell = cells[(depth, n)]
            row.append(f"{cell['accuracy']:.2f}" + (f" ({cell['baseline_accuracy']:.2f})" if has_base else ""))
        table.add_row(f"{depth:g}", *row)
    console.print(table)
    summary = f"{report['recipe']}: accuracy {report['accuracy']:.3f}"
    if has_base:
        summary += f", {baseline} {report['baseline_accuracy']:.3f}"
    if report.get("chance_accuracy") is not None:
        summary += f" (chance {report['chance_accuracy']:.2g})"
    summary += f"; kept fraction {report['kept_fraction']:.3f}; cache {_mib(report['cache_bytes'])} held"
    if report.get("reserved_cache_bytes") is not None:
        summary += f" ({_mib(report['reserved_cache_bytes'])} reserved)"
    summary += " per sequence"
    if report.get("baseline_cache_bytes") is not None:
        summary += f" vs {_mib(report['baseline_cache_bytes'])} in the {baseline}"
    if report.get("model_dtype_cache_bytes") is not None:
        summary += f" ({_mib(report['model_dtype_cache_bytes'])} in {report['model_dtype']})"
    if report.get("backend"):
        summary += f"; {report['backend']} backend"
    console.print(summary, highlight=False)
    if report.get("note"):
        console.print(f"[bold yellow]note:[/] {escape(report['note'])}", highlight=False)
    if report.get("plot"):
        console.print(f"wrote {report['plot']}")
