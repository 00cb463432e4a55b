"""mxjax.formats: the constants table against docs/NUMERICS.md, ml_dtypes and the reference."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

import mxjax
from mxjax import formats as F
from tests import reference as ref

# name -> (mbits, emin, emax, max_normal, bits), written out from NUMERICS.md
CONTRACT_ELEMENTS = {
    "e2m1": (1, 0, 2, 6.0, 4),
    "e4m3": (3, -6, 8, 448.0, 8),
    "e5m2": (2, -14, 15, 57344.0, 8),
}
# name -> (element, block_size, scale, tensor_scale), from the NUMERICS.md format table
CONTRACT_FORMATS = {
    "mxfp4": ("e2m1", 32, "e8m0", False),
    "mxfp8_e4m3": ("e4m3", 32, "e8m0", False),
    "mxfp8_e5m2": ("e5m2", 32, "e8m0", False),
    "nvfp4": ("e2m1", 16, "e4m3", True),
    "fp8_e4m3": ("e4m3", None, None, True),
    "fp8_e5m2": ("e5m2", None, None, True),
    "bf16": (None, None, None, False),
}
ML_DTYPES = {"e2m1": ml_dtypes.float4_e2m1fn, "e4m3": ml_dtypes.float8_e4m3fn,
             "e5m2": ml_dtypes.float8_e5m2}
ELEMENTS = {"e2m1": F.E2M1, "e4m3": F.E4M3, "e5m2": F.E5M2}


@pytest.mark.parametrize("name", sorted(CONTRACT_ELEMENTS))
def test_element_constants_match_contract(name):
    e = ELEMENTS[name]
    mbits, emin, emax, max_normal, bits = CONTRACT_ELEMENTS[name]
    assert (e.name, e.mbits, e.emin, e.emax, e.max_normal, e.bits) == (
        name, mbits, emin, emax, max_normal, bits)


@pytest.mark.parametrize("name", sorted(CONTRACT_ELEMENTS))
def test_element_constants_match_ml_dtypes(name):
    e = ELEMENTS[name]
    fi = ml_dtypes.finfo(ML_DTYPES[name])
    assert e.max_normal == float(fi.max)
    assert e.min_subnormal == float(fi.smallest_subnormal)
    assert e.mbits == fi.nmant
    assert 2.0**e.emin == float(fi.smallest_normal)
    # sign bit position: bit 3 for E2M1, bit 7 for the FP8 formats
    assert e.sign_bit == 1 << (e.bits - 1)


@pytest.mark.parametrize("name", sorted(CONTRACT_ELEMENTS))
def test_element_constants_match_reference(name):
    e, r = ELEMENTS[name], {"e2m1": ref.E2M1, "e4m3": ref.E4M3, "e5m2": ref.E5M2}[name]
    assert (e.ebits, e.mbits, e.emin, e.emax, e.max_normal, e.bias) == (
        r.ebits, r.mbits, r.emin, r.emax, r.max_normal, r.bias)
    assert e.max_mantissa == r.m_max
    # the largest magnitude code decodes to max_normal, the next one up is not finite-normal
    assert ref.decode(np.array([e.max_code]), r)[0] == e.max_normal


@pytest.mark.parametrize("name", sorted(CONTRACT_FORMATS))
def test_format_table_matches_contract(name):
    fmt = F.get(name)
    elem, block, scale, tscale = CONTRACT_FORMATS[name]
    assert fmt.name == name
    assert (fmt.element.name if fmt.element else None, fmt.block_size, fmt.scale,
            fmt.tensor_scale) == (elem, block, scale, tscale)
    assert fmt.is_passthrough == (name == "bf16")
    assert fmt.is_block == (block is not None)
    assert fmt.is_per_tensor == (elem is not None and block is None)
    assert fmt.packed == (elem == "e2m1")
    assert getattr(mxjax, name.upper()) is fmt
    if name != "bf16":
        assert ref.FORMATS[name].block == block and ref.FORMATS[name].scale == scale


def test_get_accepts_names_and_formats():
    assert F.get("MXFP4") is mxjax.MXFP4
    assert F.get("nvfp4") is mxjax.NVFP4
    assert F.get(mxjax.FP8_E5M2) is mxjax.FP8_E5M2
    assert set(F.FORMATS) == set(CONTRACT_FORMATS)


def test_unknown_format_raises_naming_fmt():
    with pytest.raises(ValueError, match=r"fmt.*'mxfp5'.*mxfp4"):
        F.get("mxfp5")
    with pytest.raises(ValueError, match="fmt"):
        F.get(4)


def test_enums():
    assert [r.name for r in mxjax.ScaleRule] == ["FLOOR", "EVEN", "CEIL", "RCEIL"]
    assert [r.name for r in mxjax.Rounding] == [
        "NEAREST_EVEN", "STOCHASTIC", "TOWARD_ZERO", "NEAREST_AWAY"]
    for enum in (mxjax.ScaleRule, mxjax.Rounding):
        for member in enum:
            assert member.value == member.name.lower()
    assert F.scale_rule("EVEN") is mxjax.ScaleRule.EVEN
    assert F.rounding("toward_zero") is mxjax.Rounding.TOWARD_ZERO
    with pytest.raises(ValueError, match="scale_rule"):
        F.scale_rule("round")
    with pytest.raises(ValueError, match="rounding"):
        F.rounding("nearest")


def test_formats_are_frozen_and_hashable():
    assert len({mxjax.MXFP4, mxjax.MXFP4, mxjax.NVFP4, F.E2M1, F.E2M1}) == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        mxjax.MXFP4.block_size = 16
    with pytest.raises(dataclasses.FrozenInstanceError):
        F.E4M3.mbits = 2
    with pytest.raises(TypeError):
        F.ElementFormat("e3m0", 3, 0, 0)  # keyword-only
