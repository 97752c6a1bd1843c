"""Arrays without reference counts inside the compiled CPU kernel: `borrowed`.

Numba counts references to every array it is handed (NRT's memory info: one counter per array, changed by an atomic
instruction each time compiled code makes a view, such as ``keys[t]`` or ``rows[r]``). The decode kernel makes views
per token and query row, so those counters cost more than the arithmetic: a float16 step over 3 streams x 1024
tokens took 1.07 ms with them and 0.40 ms without on one thread, and 2.4 ms on two threads sharing them against
0.23 ms without (RESULTS.md, "The CPU kernel on torch's OpenMP threads"). A kernel's arguments are owned by its
caller for the whole call, so nothing is lost by not counting them: `borrowed` hands the compiled code the same
arrays with no memory info (NRT skips a null one), and every view made from them carries none either. Only for
arguments (or what a caller keeps alive for the whole call): an array allocated in compiled code would be freed
under the borrowed copy.
"""

from __future__ import annotations

from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def borrowed(typingctx, value):
    """``value`` (an array, or a tuple of arrays, scalars and tuples) with no array's reference counted (see the
    module)."""
    if not isinstance(value, (types.Array, types.BaseTuple)):
        return None

    def codegen(context, builder, signature, args):
        return without_reference_counts(context, builder, signature.args[0], args[0])

    return value(value), codegen


def without_reference_counts(context, builder, ty, value):
    """The LLVM value ``value`` of Numba type ``ty`` with the memory-info pointer of every array in it (tuples walked)
    set to null."""
    if isinstance(ty, types.Array):
        array = context.make_array(ty)(context, builder, value=value)
        array.meminfo = cgutils.get_null_value(array.meminfo.type)
        return array._getvalue()
    if isinstance(ty, types.BaseTuple):
        for i, member in enumerate(ty.types):
            item = without_reference_counts(context, builder, member, builder.extract_value(value, i))
            value = builder.insert_value(value, item, i)
    return value
