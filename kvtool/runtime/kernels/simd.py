"""16-lane vector steps of the CPU decode kernel that Numba does not vectorize by itself, written as LLVM IR.

Numba compiles a loop to vector instructions only when LLVM's vectorizer sees through it; two loops of the TurboQuant
kernel (`cpu_decode_rotated`) stay scalar there (measured in `benchmarks/RESULTS.md`, "Where a TurboQuant decode step's
time goes"): the fast Walsh-Hadamard transform's butterflies 1, 2, 4 and 8 apart (within a vector's lanes), and a
codebook read ``codebook[code]`` (a gather). These intrinsics emit them as plain LLVM vector IR (``<16 x float>``
shuffles, selects, and element extracts that LLVM's x86 back end turns into one variable permute), so they compile for
any CPU LLVM targets: AVX-512 runs a vector per instruction, AVX2 or NEON split it. Both work in place on a
C-contiguous float32 row; their pure-numpy references are in `tests/test_cpu_decode.py`.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

LANES = 16
_FLOATS = ir.VectorType(ir.FloatType(), LANES)
_INTS = ir.VectorType(ir.IntType(32), LANES)
_MAX_LOG2 = 16
MAX_LANES_DIM = 1 << _MAX_LOG2  # the transform's passes are unrolled up to this d (callers check)


def _row(a) -> bool:
    return isinstance(a, types.Array) and a.ndim == 1 and a.dtype == types.float32 and a.layout == "C"


def _vector_at(builder, data, offset):
    return builder.bitcast(builder.gep(data, [offset]), _FLOATS.as_pointer())


@intrinsic
def walsh_hadamard_lanes(typingctx, x):
    """x (d,) float32 C-contiguous <- sqrt(d) H x in place (H the orthonormal Walsh-Hadamard matrix in Sylvester order;
    d a power of two, 16 <= d <= MAX_LANES_DIM): the butterflies 1, 2, 4 and 8 apart inside each 16-lane vector (a
    shuffle to the partner lane, then the sum or the difference by lane), the wider ones between vectors."""
    if not _row(x):
        return None

    def codegen(context, builder, signature, args):
        row = cgutils.create_struct_proxy(signature.args[0])(context, builder, value=args[0])
        d, data = row.nitems, row.data
        const = lambda v: ir.Constant(d.type, v)  # noqa: E731
        with cgutils.for_range(builder, builder.lshr(d, const(4))) as loop:
            ptr = _vector_at(builder, data, builder.shl(loop.index, const(4)))
            v = builder.load(ptr, align=4)
            for h in (1, 2, 4, 8):  # lane i pairs with i ^ h: the lower one takes the sum, the upper the difference
                partner = builder.shuffle_vector(v, v, ir.Constant(_INTS, [i ^ h for i in range(LANES)]))
                upper = ir.Constant(ir.VectorType(ir.IntType(1), LANES), [bool(i & h) for i in range(LANES)])
                v = builder.select(upper, builder.fsub(partner, v), builder.fadd(v, partner))
            builder.store(v, ptr, align=4)
        pairs = builder.lshr(d, const(5))  # vector pairs per pass
        for log in range(4, _MAX_LOG2):
            h = 1 << log
            with builder.if_then(builder.icmp_unsigned("<", const(h), d)):
                with cgutils.for_range(builder, pairs) as loop:
                    group = builder.lshr(loop.index, const(log - 4))  # pairs h apart: h / 16 vectors per half-group
                    within = builder.and_(loop.index, const(h // LANES - 1))
                    low = builder.add(builder.shl(group, const(log + 1)), builder.shl(within, const(4)))
                    p_low, p_high = _vector_at(builder, data, low), _vector_at(builder, data, builder.add(low, const(h)))
                    a, b = builder.load(p_low, align=4), builder.load(p_high, align=4)
                    builder.store(builder.fadd(a, b), p_low, align=4)
                    builder.store(builder.fsub(a, b), p_high, align=4)
        return context.get_dummy_value()

    return types.void(x), codegen


@intrinsic
def codebook_lanes(typingctx, row, table):
    """row (n,) float32 C-contiguous codes 0 .. 31 (small integers) <- table[code] for its first 16 floor(n / 16)
    entries, in place; ``table`` (32,) float32 (a codebook padded by its last level). Per vector: the codes' low four
    bits pick from each half of the table (a variable permute), the fifth bit picks the half. The caller reads the
    last n mod 16 codes itself."""
    if not (_row(row) and _row(table)):
        return None

    def codegen(context, builder, signature, args):
        codes = cgutils.create_struct_proxy(signature.args[0])(context, builder, value=args[0])
        book = cgutils.create_struct_proxy(signature.args[1])(context, builder, value=args[1])
        const = lambda v: ir.Constant(codes.nitems.type, v)  # noqa: E731
        halves = (builder.load(_vector_at(builder, book.data, const(0)), align=4),
                  builder.load(_vector_at(builder, book.data, const(LANES)), align=4))

        def permute(values, index):
            out = ir.Constant(_FLOATS, ir.Undefined)
            for lane in range(LANES):
                at = ir.Constant(ir.IntType(32), lane)
                out = builder.insert_element(out, builder.extract_element(values, builder.extract_element(index, at)), at)
            return out

        with cgutils.for_range(builder, builder.lshr(codes.nitems, const(4))) as loop:
            ptr = _vector_at(builder, codes.data, builder.shl(loop.index, const(4)))
            code = builder.fptosi(builder.load(ptr, align=4), _INTS)
            low = builder.and_(code, ir.Constant(_INTS, [LANES - 1] * LANES))
            upper = builder.icmp_signed(">=", code, ir.Constant(_INTS, [LANES] * LANES))
            builder.store(builder.select(upper, permute(halves[1], low), permute(halves[0], low)), ptr, align=4)
        return context.get_dummy_value()

    return types.void(row, table), codegen
