"""Host work of a decode step: what is computed once per forward, and the benchmark that measures it."""

import torch

from kvtool.runtime.cache import CacheContext
from kvtool.runtime.layer import new_token_mask
from tests.conftest import shared_path


def test_every_token_real_is_read_once_per_forward_mask():
    """All layers of a forward get one mask object: the (host-syncing) reading happens once; a new mask is read again,
    and a dead mask's address reused by another tensor is not mistaken for it."""
    context = CacheContext(probes=None, rope=None)
    reads = []

    def counted(mask, t, real):
        reads.append(1)
        return context.all_real(mask, t, real)

    full = torch.zeros(2, 1, 1, 1)  # additive mask: 0 = visible, every new token real
    for _ in range(5):  # five layers
        _, real = new_token_mask(full, 2, 1, "cpu", counted)
        assert real is None
    assert context.all_real(full, 1, torch.tensor([False])) is True  # cached: the tensor passed is not read again
    padded = torch.tensor([0.0, float("-inf")]).reshape(2, 1, 1, 1)  # the second sequence's new token is padding
    _, real = new_token_mask(padded, 2, 1, "cpu", context.all_real)
    assert real is not None and real.tolist() == [[True], [False]]
    del full
    reused = torch.zeros(2, 1, 1, 1)
    reused[1] = float("-inf")
    _, real = new_token_mask(reused, 2, 1, "cpu", context.all_real)
    assert real is not None  # a new object: read afresh, whatever its address


def test_host_overhead_benchmark_stubs_the_kernels_and_times_every_cache(tmp_path):
    from benchmarks.host_overhead import main

    out = tmp_path / "host.json"
    main(["--model", str(shared_path("models/kvref-5m")), "--caches", "DynamicCache", "kivi-4bit:triton", "kivi-4bit:torch",
          "--steps", "8", "--context", "40", "--out", str(out),
          "--threads", str(torch.get_num_threads())])  # the process's own: the benchmark sets it
    import json

    result = json.loads(out.read_text())
    assert {"uniform_decode._uniform_partials", "decode_attention._merge_partials", "encode_blocks._encode_uniform"} <= set(result["stubbed"])
    rows = {row["cache"]: row for row in result["rows"]}
    assert set(rows) == {"DynamicCache", "kivi-4bit:triton", "kivi-4bit:torch"}
    assert rows["DynamicCache"]["us_per_layer_over_first"] == 0 and all(row["ms_per_step"] > 0 for row in rows.values())


def test_the_stubs_are_gone_after_the_benchmark():
    import kvtool.runtime.kernels.uniform_decode as uniform_decode
    from benchmarks.host_overhead import stubbed_triton_kernels

    kernel = uniform_decode._uniform_partials
    with stubbed_triton_kernels() as names:
        assert "uniform_decode._uniform_partials" in names and uniform_decode._uniform_partials is not kernel
    assert uniform_decode._uniform_partials is kernel
