"""16-lane vector steps of the CPU decode kernel that Numba does not vectorize (well) by itself, written as LLVM IR.

Numba compiles a loop to vector instructions only when LLVM's vectorizer sees through it; these loops of the
TurboQuant kernel (`cpu_decode_rotated`) stayed scalar or slow there (measured in `benchmarks/RESULTS.md`, "Where a
TurboQuant decode step's time goes" and "The TurboQuant kernel's block reads in vector IR"):

* `walsh_hadamard_lanes`: the fast Walsh-Hadamard transform's butterflies 1, 2, 4 and 8 apart (within a vector);
* `codebook_lanes`: a codebook read ``codebook[code]`` (a gather) of float codes;
* `codebook_block_lanes`: a whole body block from its bit-sliced bytes to codebook values in one pass (Numba widened
  the bytes to 64-bit lanes, eight codes per instruction, and wrote every slice's bits back as floats);
* `tile_dots_lanes`: a block's logits, sixteen tokens' partial sums reduced together into one vector of sixteen
  logits (one horizontal reduction per row and token before);
* `weighted_rows_lanes`: a block's weighted value rows, four chunks of a row per pass over the tokens;
* `matrix_product_lanes`: a small matrix product (Palu's keys from their latents, `cpu_lowrank`), four rows by four
  chunks of sums in registers per pass, so each row of the right-hand matrix is read once per four rows.

They emit plain LLVM vector IR (``<16 x float>`` / ``<16 x i32>`` arithmetic, shuffles, selects, and element extracts
that LLVM's x86 back end turns into one variable permute), so they compile for any CPU LLVM targets: AVX-512 runs a
vector per instruction, AVX2 or NEON split it. They read and write C-contiguous rows; their pure-numpy references
are in `tests/test_cpu_decode.py`.
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


def _c_array(a, ndim: int, dtype) -> bool:
    return isinstance(a, types.Array) and a.ndim == ndim and a.dtype == dtype and a.layout == "C"


def _block(a) -> bool:
    """A C-contiguous float32 array of any rank, read as its flat row (no reshape: Numba calls a helper for each)."""
    return isinstance(a, types.Array) and a.dtype == types.float32 and a.layout == "C"


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


def _permute(builder, values, index):
    """values[index] lane by lane (<16 x float> by <16 x i32>): element extracts that LLVM's x86 back end turns into
    one variable permute."""
    out = ir.Constant(_FLOATS, ir.Undefined)
    for lane in range(LANES):
        at = ir.Constant(ir.IntType(32), lane)
        out = builder.insert_element(out, builder.extract_element(values, builder.extract_element(index, at)), at)
    return out


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

        with cgutils.for_range(builder, builder.lshr(codes.nitems, const(4))) as loop:
            ptr = _vector_at(builder, codes.data, builder.shl(loop.index, const(4)))
            code = builder.fptosi(builder.load(ptr, align=4), _INTS)
            low = builder.and_(code, ir.Constant(_INTS, [LANES - 1] * LANES))
            upper = builder.icmp_signed(">=", code, ir.Constant(_INTS, [LANES] * LANES))
            value = builder.select(upper, _permute(builder, halves[1], low), _permute(builder, halves[0], low))
            builder.store(value, ptr, align=4)
        return context.get_dummy_value()

    return types.void(row, table), codegen


def _splat(builder, value, vector=_FLOATS):
    """A 16-lane ``vector`` (float by default, or ``_INTS``) with every lane ``value``."""
    vec = builder.insert_element(ir.Constant(vector, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(vec, vec, ir.Constant(_INTS, [0] * LANES))


def _sum_lanes_by_vector(builder, vectors):
    """One vector whose lane t is the sum of the lanes of vectors[t] (16 vectors): four steps that each add the two
    halves of pairs of vectors, interleaved so the sums come out in order (15 shuffle pairs and adds, not 16 separate
    reductions)."""
    step = LANES // 2  # step 1 pairs t with t + 8, step 2 t with t + 4, ...
    while len(vectors) > 1:
        half = len(vectors) // 2
        low, high = [], []
        run = step  # a vector holds `2 run` consecutive partial sums of each token it carries
        for block in range(LANES // (2 * run)):
            base = 2 * run * block
            low += list(range(base, base + run)) + list(range(LANES + base, LANES + base + run))
            high += list(range(base + run, base + 2 * run)) + list(range(LANES + base + run, LANES + base + 2 * run))
        low_mask, high_mask = ir.Constant(_INTS, low), ir.Constant(_INTS, high)
        vectors = [builder.fadd(builder.shuffle_vector(vectors[i], vectors[i + half], low_mask),
                                builder.shuffle_vector(vectors[i], vectors[i + half], high_mask), flags=("fast",))
                   for i in range(half)]
        step //= 2
    return vectors[0]


def _fast(builder, op, a, b):
    return getattr(builder, op)(a, b, flags=("fast",))


def _block_product(a, b, c, d) -> bool:
    """The arguments of a block product: three C-contiguous float32 arrays and an integer row length."""
    return _block(a) and _block(b) and _block(c) and isinstance(d, types.Integer)


def _blocks_and_width(context, builder, signature, args):
    """The three array arguments of a block product (their data and item counts) and its row length d as an intp,
    with a constant maker of that type."""
    arrays = [cgutils.create_struct_proxy(signature.args[i])(context, builder, value=args[i]) for i in range(3)]
    width = context.cast(builder, args[3], signature.args[3], types.intp)
    return (*arrays, width, lambda v: ir.Constant(width.type, v))


@intrinsic
def tile_dots_lanes(typingctx, rows, tile, out, d):
    """out (R T,) <- rows (R d,) . tile (T d,) row by row: out[r T + t] = rows[r d : r d + d] . tile[t d : t d + d], the
    logits of R query rows against the T tokens of a block's codebook tile (each array C-contiguous, of any rank, read
    flat; d and T multiples of 16). Sixteen tokens at a time: one 16-lane partial sum per token over the row's chunks,
    then the sixteen summed together into one vector of sixteen logits (`_sum_lanes_by_vector`), not sixteen separate
    reductions."""
    if not _block_product(rows, tile, out, d):
        return None

    def codegen(context, builder, signature, args):
        q, y, o, width, const = _blocks_and_width(context, builder, signature, args)
        n_rows, n_tokens = builder.udiv(q.nitems, width), builder.udiv(y.nitems, width)
        chunks = builder.lshr(width, const(4))
        accs = [cgutils.alloca_once(builder, _FLOATS) for _ in range(LANES)]
        zero = ir.Constant(_FLOATS, [0.0] * LANES)
        with cgutils.for_range(builder, n_rows) as row_loop:
            row_at = builder.mul(row_loop.index, width)
            with cgutils.for_range(builder, builder.lshr(n_tokens, const(4))) as group_loop:
                first = builder.shl(group_loop.index, const(4))  # the group's first token
                for acc in accs:
                    builder.store(zero, acc)
                with cgutils.for_range(builder, chunks) as chunk_loop:
                    at = builder.shl(chunk_loop.index, const(4))
                    qv = builder.load(_vector_at(builder, q.data, builder.add(row_at, at)), align=4)
                    for t, acc in enumerate(accs):
                        token_at = builder.mul(builder.add(first, const(t)), width)
                        yv = builder.load(_vector_at(builder, y.data, builder.add(token_at, at)), align=4)
                        builder.store(_fast(builder, "fadd", builder.load(acc), _fast(builder, "fmul", qv, yv)), acc)
                sums = _sum_lanes_by_vector(builder, [builder.load(acc) for acc in accs])
                out_at = builder.add(builder.mul(row_loop.index, n_tokens), first)
                builder.store(sums, _vector_at(builder, o.data, out_at), align=4)
        return context.get_dummy_value()

    return types.void(rows, tile, out, d), codegen


@intrinsic
def weighted_rows_lanes(typingctx, coef, tile, summed, d):
    """summed (R d,) += coef (R T,) times tile (T d,): summed[r d + c] += sum_t coef[r T + t] tile[t d + c], a block's
    weighted value rows for R query rows (each array C-contiguous, of any rank, read flat; d a multiple of 16, T even).
    Up to four 16-lane chunks of a row per pass over the tokens, each summed in two halves (even and odd tokens), so up
    to eight independent sums keep the adds from waiting on each other."""
    if not _block_product(coef, tile, summed, d):
        return None

    def codegen(context, builder, signature, args):
        w, y, s, width, const = _blocks_and_width(context, builder, signature, args)
        n_rows, n_tokens = builder.udiv(s.nitems, width), builder.udiv(y.nitems, width)
        chunks = builder.lshr(width, const(4))
        accs = [(cgutils.alloca_once(builder, _FLOATS), cgutils.alloca_once(builder, _FLOATS)) for _ in range(4)]
        zero = ir.Constant(_FLOATS, [0.0] * LANES)

        def chunk_run(row, first_chunk, count):  # chunks first_chunk .. first_chunk + count - 1 of the row
            ats = [builder.shl(builder.add(first_chunk, const(j)), const(4)) for j in range(count)]
            row_at, coef_at = builder.mul(row, width), builder.mul(row, n_tokens)
            for (even, odd), at in zip(accs, ats):
                builder.store(builder.load(_vector_at(builder, s.data, builder.add(row_at, at)), align=4), even)
                builder.store(zero, odd)
            with cgutils.for_range(builder, builder.lshr(n_tokens, const(1))) as pair_loop:
                t = builder.shl(pair_loop.index, const(1))
                for parity in (0, 1):
                    token = builder.add(t, const(parity))
                    c = _splat(builder, builder.load(builder.gep(w.data, [builder.add(coef_at, token)])))
                    token_at = builder.mul(token, width)
                    for pair, at in zip(accs, ats):
                        yv = builder.load(_vector_at(builder, y.data, builder.add(token_at, at)), align=4)
                        acc = pair[parity]
                        builder.store(_fast(builder, "fadd", builder.load(acc), _fast(builder, "fmul", c, yv)), acc)
            for (even, odd), at in zip(accs, ats):
                total = _fast(builder, "fadd", builder.load(even), builder.load(odd))
                builder.store(total, _vector_at(builder, s.data, builder.add(row_at, at)), align=4)

        with cgutils.for_range(builder, n_rows) as row_loop:
            row = row_loop.index
            with cgutils.for_range(builder, builder.lshr(chunks, const(2))) as quad:
                chunk_run(row, builder.shl(quad.index, const(2)), 4)
            done = builder.shl(builder.lshr(chunks, const(2)), const(2))
            rest = builder.sub(chunks, done)
            with builder.if_else(builder.icmp_unsigned("==", rest, const(3))) as (three, fewer):
                with three:
                    chunk_run(row, done, 3)
                with fewer:
                    with builder.if_else(builder.icmp_unsigned("==", rest, const(2))) as (two, one):
                        with two:
                            chunk_run(row, done, 2)
                        with one:
                            with builder.if_then(builder.icmp_unsigned("==", rest, const(1))):
                                chunk_run(row, done, 1)
        return context.get_dummy_value()

    return types.void(coef, tile, summed, d), codegen


@intrinsic
def codebook_block_lanes(typingctx, codes, slices, table, tile):
    """tile (T, d) float32 <- table[code] for every code of one body block of T tokens x d channels, read in one pass
    from its bit-sliced bytes ``codes`` (rows x d uint8: slice i's rows first_i .. first_i + sub_i - 1 hold token t at
    row first_i + t mod sub_i, bits from (t div sub_i) w_i, so code = sum_i ((byte >> shift) & (2^w_i - 1)) << low_i;
    `cpu_decode_kernel.unpack_block`'s layout). ``slices`` (3, 4) int32 flat: (first, sub, w, low) per slice, w = 0
    (with sub 1) for no such slice, slices present in order; d a multiple of 16 (T and d from ``tile``); codes
    0 .. 31 (at most 5 bits) with ``table`` (32,) float32 the codebook padded by its last level (read as in
    `codebook_lanes`; one half of it for codes of at most 4 bits). 16 codes at a time in 32-bit lanes, one loop per
    number of slices."""
    if not (_c_array(codes, 2, types.uint8) and _c_array(slices, 1, types.int32) and _row(table)
            and _c_array(tile, 2, types.float32)):
        return None

    def codegen(context, builder, signature, args):
        src = context.make_array(signature.args[0])(context, builder, value=args[0])
        p = context.make_array(signature.args[1])(context, builder, value=args[1])
        book = context.make_array(signature.args[2])(context, builder, value=args[2])
        dst = context.make_array(signature.args[3])(context, builder, value=args[3])
        n_tokens, width = cgutils.unpack_tuple(builder, dst.shape, 2)
        const = lambda v: ir.Constant(width.type, v)  # noqa: E731
        int32 = ir.IntType(32)
        halves = (builder.load(_vector_at(builder, book.data, const(0)), align=4),
                  builder.load(_vector_at(builder, book.data, const(LANES)), align=4))

        fields = [builder.sext(builder.load(builder.gep(p.data, [const(i)])), width.type) for i in range(12)]
        byte_vector = ir.VectorType(ir.IntType(8), LANES).as_pointer()
        with cgutils.for_range(builder, n_tokens) as token_loop:
            t = token_loop.index
            starts, shifts, masks, lows = [], [], [], []
            for i in range(3):
                first, sub, w, low = fields[4 * i : 4 * i + 4]
                row = builder.add(first, builder.urem(t, sub))
                starts.append(builder.gep(src.data, [builder.mul(row, width)]))
                shifts.append(_splat(builder, builder.trunc(builder.mul(builder.udiv(t, sub), w), int32), _INTS))
                mask = builder.sub(builder.shl(const(1), w), const(1))
                masks.append(_splat(builder, builder.trunc(mask, int32), _INTS))
                lows.append(_splat(builder, builder.trunc(low, int32), _INTS))
            out_row = builder.mul(t, width)

            def read_row(count, wide):  # the row's codes from `count` slices; `wide`: codes past 15 (both halves)
                with cgutils.for_range(builder, builder.lshr(width, const(4))) as loop:
                    at = builder.shl(loop.index, const(4))
                    code = ir.Constant(_INTS, [0] * LANES)
                    for start, shift, mask, low in list(zip(starts, shifts, masks, lows))[:count]:
                        byte_ptr = builder.bitcast(builder.gep(start, [at]), byte_vector)
                        bits = builder.zext(builder.load(byte_ptr, align=1), _INTS)
                        code = builder.or_(code, builder.shl(builder.and_(builder.lshr(bits, shift), mask), low))
                    index = builder.and_(code, ir.Constant(_INTS, [LANES - 1] * LANES))
                    value = _permute(builder, halves[0], index)
                    if wide:
                        upper = builder.icmp_unsigned(">=", code, ir.Constant(_INTS, [LANES] * LANES))
                        value = builder.select(upper, _permute(builder, halves[1], index), value)
                    builder.store(value, _vector_at(builder, dst.data, builder.add(out_row, at)), align=4)

            def by_count(wide):  # one loop per slice count (1, 2 or 3), so no absent slice is read
                two, three = (builder.icmp_unsigned("!=", fields[4 * i + 2], const(0)) for i in (1, 2))
                with builder.if_else(three) as (has_three, fewer):
                    with has_three:
                        read_row(3, wide)
                    with fewer:
                        with builder.if_else(two) as (has_two, one):
                            with has_two:
                                read_row(2, wide)
                            with one:
                                read_row(1, wide)

            total_bits = builder.add(builder.add(fields[2], fields[6]), fields[10])
            with builder.if_else(builder.icmp_unsigned(">", total_bits, const(4))) as (wide, narrow):
                with wide:
                    by_count(True)
                with narrow:
                    by_count(False)
        return context.get_dummy_value()

    return types.void(codes, slices, table, tile), codegen


@intrinsic
def matrix_product_lanes(typingctx, a, b, out, d):
    """out (M d,) <- a (M K,) @ b (K d,): out[m d + c] = sum_k a[m K + k] b[k d + c] (each array C-contiguous, of any
    rank, read flat; d a multiple of 16; M = out's items / d, K = b's items / d). Four rows by up to four 16-lane chunks
    of sums (sixteen vectors) per pass over k, so a row of b is loaded once for four rows of a (`weighted_rows_lanes`
    loads it for every row: a product of latents and an up-projection was bound by those loads); the rows past a
    multiple of four one at a time."""
    if not _block_product(a, b, out, d):
        return None

    def codegen(context, builder, signature, args):
        x, y, o, width, const = _blocks_and_width(context, builder, signature, args)
        n_rows, depth = builder.udiv(o.nitems, width), builder.udiv(y.nitems, width)
        chunks = builder.lshr(width, const(4))
        accs = [[cgutils.alloca_once(builder, _FLOATS) for _ in range(4)] for _ in range(4)]
        zero = ir.Constant(_FLOATS, [0.0] * LANES)

        def run(row, rows, first_chunk, count):  # rows row .. row + rows - 1, chunks first_chunk .. + count - 1
            ats = [builder.shl(builder.add(first_chunk, const(j)), const(4)) for j in range(count)]
            for i in range(rows):
                for j in range(count):
                    builder.store(zero, accs[i][j])
            with cgutils.for_range(builder, depth) as k_loop:
                k = k_loop.index
                b_at = builder.mul(k, width)
                bvs = [builder.load(_vector_at(builder, y.data, builder.add(b_at, at)), align=4) for at in ats]
                for i in range(rows):
                    a_at = builder.add(builder.mul(builder.add(row, const(i)), depth), k)
                    av = _splat(builder, builder.load(builder.gep(x.data, [a_at])))
                    for j, bv in enumerate(bvs):
                        acc = accs[i][j]
                        builder.store(_fast(builder, "fadd", builder.load(acc), _fast(builder, "fmul", av, bv)), acc)
            for i in range(rows):
                row_at = builder.mul(builder.add(row, const(i)), width)
                for j, at in enumerate(ats):
                    builder.store(builder.load(accs[i][j]), _vector_at(builder, o.data, builder.add(row_at, at)), align=4)

        def row_run(row, rows):  # every chunk of rows row .. row + rows - 1: four at a time, then one at a time
            with cgutils.for_range(builder, builder.lshr(chunks, const(2))) as quad:
                run(row, rows, builder.shl(quad.index, const(2)), 4)
            done = builder.shl(builder.lshr(chunks, const(2)), const(2))
            with cgutils.for_range(builder, builder.sub(chunks, done)) as single:
                run(row, rows, builder.add(done, single.index), 1)

        with cgutils.for_range(builder, builder.lshr(n_rows, const(2))) as block_loop:
            row_run(builder.shl(block_loop.index, const(2)), 4)
        whole = builder.shl(builder.lshr(n_rows, const(2)), const(2))
        with cgutils.for_range(builder, builder.sub(n_rows, whole)) as rest_loop:
            row_run(builder.add(whole, rest_loop.index), 1)
        return context.get_dummy_value()

    return types.void(a, b, out, d), codegen
