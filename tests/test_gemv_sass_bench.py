"""bench/gemv_sass_cpu.py's reading of SASS: the K loop is the backward branch's span with the
products in it, not a longer prepass over the row (the fp8 tensor-core kernel's absmax)."""

from __future__ import annotations

import os

from bench_scripts import load_bench

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   MUFU.EX2 R2, R3 ;
        /*0020*/                   FMNMX R4, R4, R2, !PT ;
        /*0030*/                   MUFU.RCP R5, R6 ;
        /*0040*/                   FMNMX R4, R4, R5, !PT ;
        /*0050*/              @!P0 BRA 0x10 ;
        /*0060*/                   LDG.E.128 R8, desc[UR4][R10.64] ;
        /*0070*/                   FFMA R12, R8, R9, R12 ;
        /*0080*/                   FFMA R13, R8, R9, R13 ;
        /*0090*/               @P1 BRA !P5, 0x60 ;
        /*00a0*/                   EXIT ;
"""


def test_the_k_loop_is_the_one_with_the_products():
    interpret = os.environ.get("TRITON_INTERPRET")
    sass = load_bench("gemv_sass_cpu")
    assert os.environ.get("TRITON_INTERPRET") == interpret  # importing it changes nothing
    ops = sass.main_loop(SASS)
    assert ops == {"LDG.E.128": 1, "FFMA": 2, "BRA": 1}
