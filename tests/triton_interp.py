"""The Triton interpreter, without its per-call re-patching of triton.language (tests only).

Triton 3.7's interpreter patches triton.language's builtins once per kernel launch (GridExecutor), and then again
on every call of a @triton.jit device function inside the kernel (InterpretedFunction.__call__ -> _patch_lang),
though the launch's patch is still in place: an inspect.getmembers walk over the language modules each time.
A whole engine under the interpreter makes ~30 such nested calls per program (round_to, the rows helpers), and the
walks were 30 % of test_spec_graphs' time (cProfile: 39,236 _patch_lang calls for 1,246 launches, 81 of 265 s).

`install()` skips the nested walk when every language module the device function sees is already patched (its
`load` is no longer the builtin): what runs is unchanged, since a second walk over patched modules sets the same
wrappers again. The launch's own patch and its restore are left as they are. It also builds the interpreter's
Triton -> numpy dtype table once instead of on each of its ~350,000 lookups in that test (`_get_np_dtype`)."""

from __future__ import annotations

import inspect


def install() -> bool:
    """Patch the interpreter's device-function call; False when this Triton has no such interpreter."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    cls = getattr(interp, "InterpretedFunction", None)
    if cls is None or getattr(cls, "_tests_skip_repatch", False) or not hasattr(interp, "_patch_lang"):
        return False
    langs_of: dict = {}  # device function -> the language modules in its globals (what _patch_lang would walk)

    def patched(lang) -> bool:
        return not tl.core.is_builtin(getattr(lang, "load", None))

    def call(self, *args, **kwargs):
        langs = langs_of.get(self.fn)
        if langs is None:
            g = self.fn.__globals__.values()
            langs = langs_of[self.fn] = [v for v in g if inspect.ismodule(v) and v in (tl, tl.core)]
        if not (langs and all(patched(lang) for lang in langs)):
            interp._patch_lang(self.fn)  # called outside a launch, or a module the launch did not patch
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interp.InterpreterError(repr(e)) from e

    cls.__call__ = call
    _np_dtype_once(interp, tl)
    cls._tests_skip_repatch = True
    return True


def _np_dtype_once(interp, tl) -> None:
    """interp._get_np_dtype, with its table built once (the same table, read the same way)."""
    slow = interp._get_np_dtype
    table = {t: slow(t) for t in (tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16,
             tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64, tl.bfloat16, tl.float8e5, tl.float8e5b16,
             tl.float8e4nv, tl.float8e4b8, tl.float8e4b15)}  # fmt: skip
    pointer = interp.np.dtype(interp.np.uint64)

    def get(tt_dtype):
        if isinstance(tt_dtype, tl.pointer_type):
            return pointer
        if isinstance(tt_dtype, tl.block_type):
            ty = tt_dtype.element_ty
            return pointer if isinstance(ty, tl.pointer_type) else table[ty]
        return table[tt_dtype]

    interp._get_np_dtype = get
