"""The dlib .dat reader on bytes built here by hand, plus one pass over the real ResNet file."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from model_build.dlib_dat import (
    AddPrevLayer,
    AffineLayer,
    ConvLayer,
    DatReader,
    FcLayer,
    PassThrough,
    PoolLayer,
    ReluLayer,
    parse_dnn,
    read_dnn,
)
from models import weights
from models.errors import ModelFormatError

# ---- encoders for dlib's primitives (written from the format description, used to build inputs) ----


def enc_int(value: int) -> bytes:
    magnitude = abs(value)
    body = magnitude.to_bytes(max(1, (magnitude.bit_length() + 7) // 8), "little")
    return bytes([len(body) | (0x80 if value < 0 else 0)]) + body


def enc_float(mantissa: int, exponent: int) -> bytes:
    return enc_int(mantissa) + enc_int(exponent)


def enc_bool(value: bool) -> bytes:
    return b"1" if value else b"0"


def enc_str(text: str) -> bytes:
    return enc_int(len(text)) + text.encode("ascii")


def enc_tensor(array: np.ndarray) -> bytes:
    shape = array.shape if array.ndim == 4 else (array.size, 1, 1, 1)
    return enc_int(2) + b"".join(enc_int(d) for d in shape) + array.astype("<f4").tobytes()


def enc_alias(n: int, k: int, nr: int = 1, nc: int = 1) -> bytes:
    return enc_int(1) + b"".join(enc_int(d) for d in (n, k, nr, nc))


ONE = enc_float(16, -4)  # how dlib writes 1.0
EMPTY = enc_tensor(np.zeros((0, 0, 0, 0), np.float32))
LAYER_STATE = b"110" + EMPTY * 3


def reader(data: bytes) -> DatReader:
    return DatReader(data, "synthetic.dat")


# ---- primitives ----


@pytest.mark.parametrize(
    "value", [0, 1, 127, 255, 256, 65535, 2**40 + 7, 2**63 - 1, -1, -128, -300, -(2**62)]
)
def test_int_round_trip(value: int) -> None:
    r = reader(enc_int(value))
    assert r.read_int() == value
    assert r.at_end()


def test_int_known_encodings() -> None:
    # Bytes as they appear in the real file: 0 -> 01 00, 150 -> 01 96, -28 -> 81 1c, 256 -> 02 00 01.
    r = reader(bytes.fromhex("0100 0196 811c 020001"))
    assert [r.read_int() for _ in range(4)] == [0, 150, -28, 256]


def test_bad_int_control_byte_names_file_and_offset() -> None:
    r = reader(enc_int(5) + bytes([0x19]))
    r.read_int()
    with pytest.raises(ModelFormatError, match=r"synthetic\.dat.*offset 2"):
        r.read_int()


def test_floats() -> None:
    data = (
        ONE
        + enc_float(10066330, -24)  # dlib's 0.6 threshold as stored in the ResNet file
        + enc_float(-3, 1)
        + enc_float(0, 0)
        + enc_float(1, 32000)  # reserved exponents: +inf, -inf, nan
        + enc_float(1, 32001)
        + enc_float(1, 32002)
    )
    r = reader(data)
    assert r.read_float() == 1.0
    assert r.read_float() == pytest.approx(0.6, abs=1e-7)
    assert r.read_float() == -6.0
    assert r.read_float() == 0.0
    assert r.read_float() == math.inf
    assert r.read_float() == -math.inf
    assert math.isnan(r.read_float())
    assert r.at_end()


def test_float_exponent_out_of_int16_range_is_rejected() -> None:
    with pytest.raises(ModelFormatError, match="float out of range"):
        reader(enc_float(1, 40000)).read_float()


def test_bools_and_strings() -> None:
    r = reader(b"10" + enc_str("con_4") + enc_str(""))
    assert r.read_bool() is True
    assert r.read_bool() is False
    assert r.read_string() == "con_4"
    assert r.read_string() == ""
    assert r.at_end()


def test_bad_bool_byte() -> None:
    with pytest.raises(ModelFormatError, match=r"boolean.*offset 0"):
        reader(b"\x01").read_bool()


def test_tensor_round_trip_little_endian() -> None:
    array = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5) / 7 - 3
    r = reader(enc_tensor(array) + EMPTY)
    got = r.read_tensor()
    assert got.dtype == np.float32 and got.shape == (2, 3, 4, 5)
    np.testing.assert_array_equal(got, array)
    assert r.read_tensor().shape == (0, 0, 0, 0)
    assert r.at_end()
    # The payload really is little-endian float32: 1.0 is 00 00 80 3f.
    one = enc_tensor(np.ones((1, 1, 1, 1), np.float32))
    assert one.endswith(bytes.fromhex("0000803f"))


def test_tensor_wrong_version() -> None:
    with pytest.raises(ModelFormatError, match="tensor version 1"):
        reader(enc_int(1) + enc_int(1) * 4).read_tensor()


def test_truncated_tensor_names_file_and_offset() -> None:
    data = enc_tensor(np.ones((1, 2, 3, 4), np.float32))
    with pytest.raises(ModelFormatError, match=r"synthetic\.dat.*truncated.*offset 10"):
        reader(data[:-1]).read_tensor()


def test_huge_tensor_dimensions_fail_before_allocating() -> None:
    data = enc_int(2) + b"".join(enc_int(d) for d in (2**30, 2**30, 1, 1)) + b"\0" * 8
    with pytest.raises(ModelFormatError, match="truncated"):
        reader(data).read_tensor()


# ---- whole networks ----


def tiny_network(fc_weights: np.ndarray, conv_filters: np.ndarray, conv_biases: np.ndarray) -> bytes:
    """fc_no_bias< relu< tag1< con<2,1,1,1,1, input_rgb_image_sized<4> > > > >, serialized like dlib."""
    n_in, n_out = fc_weights.shape
    out, k = conv_filters.shape[:2]
    con = (
        enc_str("con_4")
        + enc_tensor(np.concatenate([conv_filters.ravel(), conv_biases]))
        + b"".join(enc_int(v) for v in (out, 1, 1, 1, 1, 0, 0))
        + enc_alias(out, k)
        + enc_alias(1, out)
        + ONE * 4
    )
    fc = (
        enc_str("fc_2")
        + enc_int(n_out)
        + enc_int(n_in)
        + enc_tensor(fc_weights.ravel())
        + enc_alias(n_in, n_out)
        + enc_alias(0, 0, 0, 0)
        + enc_int(1)  # FC_NO_BIAS
        + ONE * 4
    )
    return (
        enc_int(1)
        + enc_str("loss_metric_2")
        + enc_float(10737418, -28)
        + enc_float(10066330, -24)
        + enc_int(2)  # add_layer<fc>
        + enc_int(2)  # add_layer<relu>
        + enc_int(1)  # tag1
        + enc_int(3)  # add_layer<con, input>
        + enc_str("input_rgb_image_sized")
        + enc_float(3, -1)
        + enc_float(1, 0)
        + enc_float(0, 0)
        + enc_int(4)
        + enc_int(4)
        + con
        + LAYER_STATE
        + enc_int(1)  # sample expansion factor
        + enc_str("relu_")
        + LAYER_STATE
        + fc
        + LAYER_STATE
    )


def test_parse_tiny_network() -> None:
    rng = np.random.default_rng(0)
    fc_w = rng.standard_normal((6, 5)).astype(np.float32)
    filters = rng.standard_normal((2, 3, 1, 1)).astype(np.float32)
    biases = np.array([0.5, -0.25], np.float32)
    net = parse_dnn(tiny_network(fc_w, filters, biases), "tiny.dat")

    assert net.loss.kind == "loss_metric_2"
    assert net.loss.values == pytest.approx((0.04, 0.6), abs=1e-7)
    assert net.input.avg_rgb == (1.5, 1.0, 0.0)
    assert (net.input.rows, net.input.cols) == (4, 4)
    assert [type(layer) for layer in net.layers] == [ConvLayer, PassThrough, ReluLayer, FcLayer]
    conv, _, _, fc = net.layers
    assert isinstance(conv, ConvLayer) and isinstance(fc, FcLayer)
    np.testing.assert_array_equal(conv.filters, filters)
    assert conv.biases is not None
    np.testing.assert_array_equal(conv.biases, biases)
    assert conv.stride == (1, 1) and conv.padding == (0, 0)
    np.testing.assert_array_equal(fc.weights, fc_w)  # (inputs, outputs), y = x @ W
    assert fc.biases is None


def plain_tiny_network() -> bytes:
    return tiny_network(
        np.ones((6, 5), np.float32), np.ones((2, 3, 1, 1), np.float32), np.zeros(2, np.float32)
    )


def test_trailing_bytes_are_an_error() -> None:
    data = plain_tiny_network()
    with pytest.raises(ModelFormatError, match="trailing data"):
        parse_dnn(data + b"\0", "tiny.dat")


def test_unknown_layer_type_is_named() -> None:
    data = plain_tiny_network()
    with pytest.raises(ModelFormatError, match=r"tiny\.dat: unsupported layer type 'relu_x'"):
        parse_dnn(data.replace(enc_str("relu_"), enc_str("relu_x")), "tiny.dat")


@pytest.fixture(scope="module")
def resnet_bytes() -> bytes:
    return weights.resolve("dlib_resnet_v1").read_bytes()


def test_real_resnet_file_structure(resnet_bytes: bytes, tmp_path: Path) -> None:
    path = tmp_path / "resnet.dat"
    path.write_bytes(resnet_bytes)
    net = read_dnn(path)
    assert net.input.avg_rgb == pytest.approx((122.782, 117.001, 104.298), abs=1e-4)
    kinds = [type(layer) for layer in net.layers]
    assert kinds.count(ConvLayer) == 29
    assert kinds.count(AffineLayer) == 29
    assert kinds.count(ReluLayer) == 29
    assert kinds.count(AddPrevLayer) == 14
    assert kinds.count(PoolLayer) == 6  # max_pool, 4 down-sampling avg_pools, avg_pool_everything
    assert kinds.count(PassThrough) == 14 + 2 * 4  # tag1 per block; tag2 + skip1 per down block
    first, last = net.layers[0], net.layers[-1]
    assert isinstance(first, ConvLayer) and first.filters.shape == (32, 3, 7, 7)
    assert first.stride == (2, 2) and first.padding == (0, 0)
    assert isinstance(last, FcLayer) and last.weights.shape == (256, 128) and last.biases is None
    strided = [layer for layer in net.layers if isinstance(layer, ConvLayer) and layer.stride == (2, 2)]
    assert all(layer.padding == (0, 0) for layer in strided)
    unit = [layer for layer in net.layers if isinstance(layer, ConvLayer) and layer.stride == (1, 1)]
    assert all(layer.padding == (1, 1) for layer in unit)


@pytest.mark.parametrize("keep", [1, 300, 20_000, 11_000_000])
def test_truncated_real_file_names_the_file(resnet_bytes: bytes, tmp_path: Path, keep: int) -> None:
    path = tmp_path / "cut.dat"
    path.write_bytes(resnet_bytes[:keep])
    with pytest.raises(ModelFormatError, match=rf"{path.name}.*offset \d+"):
        read_dnn(path)
