"""The CPU decode kernel's threaded step on torch's own OpenMP threads (`openmp_team.py`, `team_launch.py`): found
where torch runs on OpenMP, taken by large steps only, the same attention as one thread, in a model too; and the
kernel's arguments taken without reference counts (`borrowed.py`): nothing leaked, nothing changed."""

from __future__ import annotations

import importlib.util
import multiprocessing
import sys

import pytest
import torch

from tests.test_cpu_decode import RECIPES, _cpu_args, _generate
from tests.test_kernels import build_case
from tests.tiny_models import tiny_model, tiny_tokenizer_free_inputs

pytestmark = pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba is not installed")

ON_OPENMP = sys.platform.startswith("linux") and "parallel backend: OpenMP" in torch.__config__.parallel_info()


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def _team():
    from kvtool.runtime.kernels.openmp_team import openmp_team

    return openmp_team()


@pytest.mark.skipif(not ON_OPENMP, reason="torch does not run on OpenMP here")
def test_torchs_openmp_runtime_is_found_where_torch_runs_on_it():
    """On Linux torch's wheels run on OpenMP: the team must be found there (else threaded steps silently stop)."""
    team = _team()
    assert team is not None
    assert all(address > 0 for address in (team.gomp_parallel, team.thread_num, team.num_threads))


@pytest.mark.skipif(not ON_OPENMP, reason="torch does not run on OpenMP here")
@pytest.mark.parametrize("side", ["uniform-4", "turboquant-2.5-3.5"])
def test_a_large_step_spreads_over_the_team_and_a_small_one_does_not(side, two_threads, monkeypatch):
    """``parallel=None``: a step of at least `SPREAD_MIN_WORK` runs on the team (its count grows by one) and gives the
    dense reference's attention; under it, or with one torch thread, it runs on this thread."""
    from kvtool.runtime.kernels import cpu_decode

    args, reference = build_case(side, 64, 4, "cpu", seed=5)
    team = _team()
    for minimum, threads, spreads in ((0, 2, True), (1 << 40, 2, False), (0, 1, False)):
        monkeypatch.setattr(cpu_decode, "SPREAD_MIN_WORK", minimum)
        torch.set_num_threads(threads)
        before = team.runs
        out = cpu_decode.cpu_decode_attention(**_cpu_args(args))
        assert team.runs == before + spreads
        torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not ON_OPENMP, reason="torch does not run on OpenMP here")
def test_a_team_smaller_than_its_ranges_still_runs_every_item(two_threads, monkeypatch):
    """OpenMP gives a smaller team than asked inside another parallel region: each thread then takes every size-th
    range. A team of one thread over seven ranges gives the output of the same step on one thread, bit for bit."""
    import numpy as np

    from kvtool.runtime.kernels import cpu_decode

    kernels = cpu_decode._kernel()
    captured = {}
    monkeypatch.setattr(cpu_decode, "_kernel", lambda: {**kernels, False: (lambda *a: captured.update(args=a), kernels[False][1])})
    args, reference = build_case("uniform-4", 64, 4, "cpu", seed=9)
    cpu_decode.cpu_decode_attention(**_cpu_args(args), parallel=True, parts=3)
    a = captured["args"][:32]  # `decode_step`'s arguments before the scratch (the last one: ``out``)
    q, lengths, blocks, bs, parts = a[0], a[8], a[10], a[16], a[30]
    team = _team()
    cuts = np.linspace(0, q.shape[0] * parts, 8).astype(np.int64)
    one_thread = ((0, 0, 0), 1, np.zeros((1, 2), np.int64))
    team_of_one = ((team.gomp_parallel, team.thread_num, team.num_threads), 1, np.stack([cuts[:-1], cuts[1:]], axis=1))
    outs = []
    for team_arguments in (one_thread, team_of_one):
        out = np.empty_like(a[31])
        kernels[False][0](*a[:31], out, *kernels["scratch"](q, lengths, blocks, bs, parts), *team_arguments)
        outs.append(out)
    assert np.array_equal(outs[0], outs[1])
    torch.testing.assert_close(torch.from_numpy(outs[1]), reference, rtol=1e-4, atol=1e-4)


def _team_in_child(queue) -> None:
    from kvtool.runtime.kernels.openmp_team import openmp_team

    queue.put(openmp_team() is None)


@pytest.mark.skipif(not ON_OPENMP, reason="torch does not run on OpenMP here")
def test_a_forked_process_does_not_use_its_parents_team():
    """OpenMP's threads do not survive a fork: a child forked after the parent found its team runs serially."""
    assert _team() is not None
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_team_in_child, args=(queue,))
    child.start()
    child.join(60)
    assert child.exitcode == 0 and queue.get(timeout=5) is True


@pytest.mark.skipif(not ON_OPENMP, reason="torch does not run on OpenMP here")
def test_a_renamed_runtime_is_found_among_the_mapped_libraries(monkeypatch):
    """Wheels that bundle their OpenMP runtime may rename it (``libgomp-<hash>.so.1``): found by the path mapped into
    the process when no usual name matches, and it is torch's own copy (the same entry points)."""
    from kvtool.runtime.kernels import openmp_team

    usual = _team()
    monkeypatch.setattr(openmp_team, "_TEAM", {})
    monkeypatch.setattr(openmp_team, "_LIBRARIES", ("libkvtool-no-such-runtime.so",))
    found = openmp_team.openmp_team()
    assert found is not None and found.gomp_parallel == usual.gomp_parallel


def test_the_team_can_be_turned_off(two_threads, monkeypatch):
    """``KVTOOL_CPU_TEAM=0``: no team (every step on one thread unless ``parallel=True`` asks for Python threads). The
    Python threads' path (what a torch without OpenMP runs) gives the dense reference's attention, split into parts."""
    from kvtool.runtime.kernels import cpu_decode, openmp_team

    monkeypatch.setattr(openmp_team, "_TEAM", {})
    monkeypatch.setenv("KVTOOL_CPU_TEAM", "0")
    assert openmp_team.openmp_team() is None
    on_threads, python_threads = [], cpu_decode._decode_on_python_threads
    monkeypatch.setattr(cpu_decode, "_decode_on_python_threads", lambda *a: on_threads.append(1) or python_threads(*a))
    args, reference = build_case("uniform-4", 64, 4, "cpu", seed=13)
    out = cpu_decode.cpu_decode_attention(**_cpu_args(args), parallel=True, parts=3)
    assert on_threads == [1]
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not ON_OPENMP, reason="torch does not run on OpenMP here")
def test_a_model_whose_steps_spread_generates_the_torch_backends_tokens(two_threads, monkeypatch):
    """Every decode step spread over the team (`SPREAD_MIN_WORK` 0): batch of two, left padding, the torch backend's
    tokens and logits, and the team really ran in nearly every layer's step."""
    from kvtool.runtime.kernels import cpu_decode

    monkeypatch.setattr(cpu_decode, "SPREAD_MIN_WORK", 0)
    model = tiny_model("llama", kv_heads=2)
    ids, mask = tiny_tokenizer_free_inputs(batch=2, seq=70)
    by_torch, _ = _generate(model, RECIPES["kivi-3bit"], "torch", ids, mask)
    before = _team().runs
    by_numba, _ = _generate(model, RECIPES["kivi-3bit"], "numba", ids, mask)
    assert _team().runs - before >= 20 * model.config.num_hidden_layers
    assert torch.equal(by_torch.sequences, by_numba.sequences)
    torch.testing.assert_close(torch.stack(by_numba.logits), torch.stack(by_torch.logits), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("side", ["uniform-4", "turboquant-2.5-3.5", "float"])
def test_borrowed_arguments_leak_nothing_and_change_nothing(side, two_threads):
    """The kernel takes its arguments without reference counts (`borrowed.py`): many steps, on one thread and on the
    team, allocate and free the same number of blocks in Numba's runtime, give the same output every time, and leave
    the arguments' own Python reference counts as they were."""
    import sys as system

    from numba.core.runtime import _nrt_python as nrt

    from kvtool.runtime.kernels import cpu_decode

    args, reference = build_case(side, 64, 4, "cpu", seed=11)
    cpu_args = _cpu_args(args)
    if side == "float":  # the float region alone
        cpu_args = {k: cpu_args[k] for k in ("q", "new_k", "new_v", "float_k", "float_v", "float_table", "float_len")}
    first = cpu_decode.cpu_decode_attention(**cpu_args, parallel=False)
    cpu_decode.cpu_decode_attention(**cpu_args, parallel=True)  # both compiled before counting
    counts = [system.getrefcount(cpu_args[name]) for name in ("q", "float_k", "float_len")]
    was_on = nrt.memsys_stats_enabled()
    nrt.memsys_enable_stats()
    try:
        before = (nrt.memsys_get_stats_alloc() - nrt.memsys_get_stats_free(),
                  nrt.memsys_get_stats_mi_alloc() - nrt.memsys_get_stats_mi_free())
        outs = [cpu_decode.cpu_decode_attention(**cpu_args, parallel=step % 2 == 1) for step in range(20)]
        after = (nrt.memsys_get_stats_alloc() - nrt.memsys_get_stats_free(),
                 nrt.memsys_get_stats_mi_alloc() - nrt.memsys_get_stats_mi_free())
    finally:
        if not was_on:
            nrt.memsys_disable_stats()
    assert after == before
    assert [system.getrefcount(cpu_args[name]) for name in ("q", "float_k", "float_len")] == counts
    for step, out in enumerate(outs):
        torch.testing.assert_close(out, first, rtol=0 if step % 2 == 0 else 1e-5, atol=0 if step % 2 == 0 else 1e-5)
    if side != "float":
        torch.testing.assert_close(first, reference, rtol=1e-4, atol=1e-4)
