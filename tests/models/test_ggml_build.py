"""The build flags of the `gguf` extra (ggml.cmake_args): one llama-cpp-python build that runs on
every CPU kind of these machines, or one for an AVX-512 CPU, never -march=native and never AMX."""

import pytest

from foveal.engine.models import ggml

EPYC_AVX2 = {"avx", "avx2", "fma", "f16c"}
XEON_AMX = EPYC_AVX2 | {"avx512f", "avx512vbmi", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"}


def test_the_portable_build_is_avx2_without_avx512_or_amx_on_any_cpu():
    for flags in (EPYC_AVX2, XEON_AMX):
        args = ggml.cmake_args(flags, avx512=False).split()
        assert "-DGGML_NATIVE=OFF" in args and "-DGGML_AVX2=ON" in args and "-DGGML_AVX512=OFF" in args
        assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(args)
        assert "-DGGML_OPENMP=OFF" in args  # torch's libgomp would be ggml's too (ggml.AVX2_ARGS)


def test_an_avx512_build_takes_the_extensions_the_cpu_has_and_still_no_amx():
    args = ggml.cmake_args(XEON_AMX).split()
    assert {"-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON"} <= set(args)
    assert "-DGGML_AMX_TILE=OFF" in args and not any(a.startswith("-DGGML_AMX") and a.endswith("=ON") for a in args)
    assert "-DGGML_AVX512=OFF" in ggml.cmake_args(EPYC_AVX2).split()  # no AVX-512 to use
    with pytest.raises(ValueError, match="no AVX2"):
        ggml.cmake_args({"sse4_2"})
