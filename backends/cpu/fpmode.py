"""Subnormal floats flushed to zero inside a kernel (x86's MXCSR FTZ and DAZ bits, set on entry
and restored on exit, on whichever thread runs it). For kernels that multiply one value by many
(the recurrent states' decays and keys): on Intel every subnormal operand or result costs a
microcode assist of ~100 cycles, and random or outlying activations give them (silu of a large
negative input, exp of a decay of -800). Only values below 1.2e-38 change. Elsewhere (aarch64),
nothing is set."""
from __future__ import annotations

import platform

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .halfs import _call

X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
_FTZ_DAZ = 0x8040


def _mxcsr_call(builder, name, ptr):  # stmxcsr / ldmxcsr take the 32-bit word's address as i8*
    _call(builder, f"llvm.x86.sse.{name}", ir.VoidType(), [builder.bitcast(ptr, ir.IntType(8).as_pointer())])


@intrinsic
def flush_subnormals(typingctx):
    """Sets FTZ and DAZ; returns the mode to give restore_mode (0 where nothing was set)."""
    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        if not X86:
            return ir.Constant(i32, 0)
        old = cgutils.alloca_once(builder, i32)
        _mxcsr_call(builder, "stmxcsr", old)
        prev = builder.load(old)
        new = cgutils.alloca_once_value(builder, builder.or_(prev, ir.Constant(i32, _FTZ_DAZ)))
        _mxcsr_call(builder, "ldmxcsr", new)
        return prev
    return types.uint32(), codegen


@intrinsic
def restore_mode(typingctx, prev):
    """Puts back the mode flush_subnormals returned."""
    def codegen(context, builder, sig, args):
        if X86:
            _mxcsr_call(builder, "ldmxcsr", cgutils.alloca_once_value(builder, args[0]))
        return context.get_dummy_value()
    return types.void(types.uint32), codegen
