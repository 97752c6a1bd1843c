"""Compiled code that runs a function on a team of OpenMP threads: ``GOMP_parallel`` called from Numba, with no Python
on the team's threads (`openmp_team.py` finds the runtime; `cpu_decode.py` uses it for a threaded decode step).

Why compiled: a Python callback on another thread needs the GIL and a Python thread state there, and on the 2-core
VM of RESULTS.md that cost 45-64 us per run against 2-5 us for a compiled one: as much as the work a 512-token step
of SmolLM2-135M could split.

`team_runner(body)` returns an intrinsic ``run(gomp_parallel, thread_num, num_threads, threads, payload)`` for
compiled callers (``nogil``): it writes ``payload`` (a tuple of arrays and scalars) on the caller's stack, emits
``worker(void *)`` beside the caller (it loads the tuple back, asks OpenMP for its thread number and the team's
size, and calls ``body(payload, thread, size)``), and calls ``GOMP_parallel(worker, &payload, threads, 0)``: the
calling thread runs the worker as thread 0, torch's OpenMP threads the others, and the call returns once all have.
The three runtime entry points come in as integer addresses (from ctypes, at run time), so the compiled code is
cached on disk like the rest of the kernel. ``body`` divides the work by thread number and team size (a team may be
smaller than asked: one thread inside another parallel region). The payload is borrowed (the caller's frame keeps
every array alive until the call returns; on the team its arrays are not reference-counted: `borrowed.py`), and
``body`` must not raise: an exception on a team thread has nowhere to go (the decode items never raise: no bounds
checks, no Python objects).
"""

from __future__ import annotations

import itertools

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kvtool.runtime.kernels.borrowed import without_reference_counts

_WORKERS = itertools.count()  # worker function names, unique in the process (internal linkage: never clash across modules)


def team_runner(body):
    """The intrinsic that runs ``body(payload, thread, size)`` on each thread of an OpenMP team (see the module)."""

    @intrinsic
    def run_on_team(typingctx, gomp_parallel, thread_num, num_threads, threads, payload):
        if not all(isinstance(t, types.Integer) for t in (gomp_parallel, thread_num, num_threads, threads)):
            return None
        if not isinstance(payload, types.BaseTuple):
            return None
        signature = types.void(gomp_parallel, thread_num, num_threads, threads, payload)
        body_signature = types.void(payload, types.int64, types.int64)

        def codegen(context, builder, sig, args):
            gomp_address, thread_address, size_address, count, value = args
            i32, i64 = ir.IntType(32), ir.IntType(64)
            shared = ir.LiteralStructType([i64, i64, context.get_value_type(payload)])  # {thread_num, num_threads, payload}
            worker_type = ir.FunctionType(ir.VoidType(), [cgutils.voidptr_t])
            worker = ir.Function(builder.module, worker_type, name=f"kvtool_team_worker_{next(_WORKERS)}")
            worker.linkage = "internal"
            w = ir.IRBuilder(worker.append_basic_block("entry"))
            data = w.bitcast(worker.args[0], shared.as_pointer())
            int_function = ir.FunctionType(i32, []).as_pointer()
            thread = w.call(w.inttoptr(w.load(cgutils.gep_inbounds(w, data, 0, 0)), int_function), [])
            size = w.call(w.inttoptr(w.load(cgutils.gep_inbounds(w, data, 0, 1)), int_function), [])
            loaded = without_reference_counts(context, w, payload, w.load(cgutils.gep_inbounds(w, data, 0, 2)))
            compiled = context.compile_subroutine(w, body, body_signature)
            context.call_internal_no_propagate(w, compiled.fndesc, body_signature, [loaded, w.sext(thread, i64), w.sext(size, i64)])
            w.ret_void()

            slot = cgutils.alloca_once(builder, shared)
            builder.store(_to_i64(builder, thread_address), cgutils.gep_inbounds(builder, slot, 0, 0))
            builder.store(_to_i64(builder, size_address), cgutils.gep_inbounds(builder, slot, 0, 1))
            builder.store(value, cgutils.gep_inbounds(builder, slot, 0, 2))
            gomp_type = ir.FunctionType(ir.VoidType(), [worker_type.as_pointer(), cgutils.voidptr_t, i32, i32]).as_pointer()
            builder.call(
                builder.inttoptr(_to_i64(builder, gomp_address), gomp_type),
                [worker, builder.bitcast(slot, cgutils.voidptr_t), builder.trunc(_to_i64(builder, count), i32), ir.Constant(i32, 0)],
            )
            return context.get_dummy_value()

        return signature, codegen

    return run_on_team


def _to_i64(builder, value):
    """An integer argument widened (or kept) to 64 bits."""
    i64 = ir.IntType(64)
    if value.type.width == 64:
        return value
    return builder.sext(value, i64) if value.type.width < 64 else builder.trunc(value, i64)
