"""Peak memory and wall time of `kvtool calibrate`: in memory vs layer by layer (optionally offloaded).

Each configuration runs in a fresh process (so peaks do not mix); a thread samples
/proc/self/status every 5 ms. Reported: VmHWM (peak resident set, including file pages of
memory-mapped checkpoints, which the kernel can drop) and the peak of RssAnon (private memory:
what really has to fit), both in MiB, and the wall time of `api.calibrate` (load included).

    python -m benchmarks.layer_by_layer_memory --model ~/.cache/kvtool-test-models/smollm2-135m \
        --recipe kivi-4bit --recipe kvquant-3bit-1pct --max-memory 100MB --json lbl.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
DATA = str(SHARED / "data/text/wikitext2_valid.txt") + "[0:0.9]"
MODES = ("in-memory", "layer-by-layer", "layer-by-layer+offload")


def _status() -> dict[str, int]:
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) // 1024 for k in ("VmRSS", "RssAnon", "VmHWM")}


def child(model: str, recipe: str, mode: str, samples: int, seq_len: int, max_memory: str) -> dict:
    """One calibration in this process; returns the figures."""
    from kvtool import api

    peak = {"RssAnon": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak["RssAnon"] = max(peak["RssAnon"], _status()["RssAnon"])
            time.sleep(0.005)

    baseline = _status()
    threading.Thread(target=sample, daemon=True).start()
    load = api.LoadOptions(max_memory=max_memory if mode.endswith("offload") else None)
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        artifact = api.calibrate(DATA, Path(folder) / "calib.safetensors", model, recipe, samples=samples,
                                 seq_len=seq_len, batch_size=4, load=load, layer_by_layer=mode != "in-memory")
        seconds = time.perf_counter() - start
    stop.set()
    return {
        "model": Path(model).name, "recipe": recipe, "mode": mode, "samples": samples, "seq_len": seq_len,
        "max_memory": load.max_memory, "seconds": round(seconds, 1), "imports_rss_mib": baseline["VmRSS"],
        "peak_rss_mib": _status()["VmHWM"], "peak_anon_mib": peak["RssAnon"], "quality": artifact.manifest["quality"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", required=True)
    parser.add_argument("--recipe", action="append", default=None)
    parser.add_argument("--mode", action="append", choices=MODES, default=None)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--max-memory", default="100MB")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    recipes, modes = args.recipe or ["kivi-4bit"], args.mode or list(MODES)
    if args.child:
        print(json.dumps(child(args.model[0], recipes[0], modes[0], args.samples, args.seq_len, args.max_memory)))
        return
    rows = []
    print("| model | recipe | mode | wall s | peak RSS MiB | peak private (anon) MiB | K / V SQNR dB |")
    print("|---|---|---|---|---|---|---|")
    for model in args.model:
        for recipe in recipes:
            for mode in modes:
                command = [sys.executable, "-m", "benchmarks.layer_by_layer_memory", "--child", "--model", model,
                           "--recipe", recipe, "--mode", mode, "--samples", str(args.samples),
                           "--seq-len", str(args.seq_len), "--max-memory", args.max_memory]
                done = subprocess.run(command, capture_output=True, text=True, check=True,
                                      cwd=Path(__file__).resolve().parents[1], env={**os.environ, "TQDM_DISABLE": "1"})
                row = json.loads(done.stdout.strip().splitlines()[-1])
                rows.append(row)
                q = row["quality"]
                print(f"| {row['model']} | {recipe} | {mode}{' ' + row['max_memory'] if row['max_memory'] else ''} | "
                      f"{row['seconds']} | {row['peak_rss_mib']} | {row['peak_anon_mib']} | "
                      f"{q.get('keys_sqnr_db', 0):.2f} / {q.get('values_sqnr_db', 0):.2f} |", flush=True)
    if args.json:
        from kvtool.fileio import write_json_atomic

        write_json_atomic(args.json, {"rows": rows})


if __name__ == "__main__":
    main()
