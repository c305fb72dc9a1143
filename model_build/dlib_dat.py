"""Reader for dlib's serialized DNN files (``*.dat`` written by ``serialize(file) << net``).

Only the parts of the format that the ResNet face descriptor uses are understood; anything else is a
ModelFormatError naming the file and byte offset, never a silent guess. The layout of a whole file is:

* ``add_loss_layer``: version int, loss record (type string + its floats), then the subnetwork;
* each wrapper writes its version int before recursing into its subnetwork, so the versions appear from
  the outermost layer inwards: 2 for ``add_layer``, 1 for tag/skip layers (which store no id), 3 for the
  innermost ``add_layer`` whose subnetwork is the input layer;
* the input layer record, then each ``add_layer``'s record from the innermost outwards, each followed by
  three booleans and (normally empty) gradient/output tensors.

The topology (which tag a skip or add_prev refers to) is not stored; callers must know the network.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from models.errors import ModelFormatError

# float_details in dlib encodes non-finite values through these reserved exponents.
_EXPONENT_INF = 32000
_EXPONENT_NEG_INF = 32001
_EXPONENT_NAN = 32002

_TENSOR_VERSION = 2
_ALIAS_TENSOR_VERSION = 1


class DatReader:
    """Sequential reader of dlib's primitive encodings over an in-memory byte string."""

    def __init__(self, data: bytes, source: str | Path) -> None:
        self._data = memoryview(data)
        self._source = str(source)
        self._offset = 0

    @property
    def offset(self) -> int:
        return self._offset

    @property
    def source(self) -> str:
        return self._source

    def at_end(self) -> bool:
        return self._offset == len(self._data)

    def error(self, message: str, offset: int | None = None) -> ModelFormatError:
        where = self._offset if offset is None else offset
        return ModelFormatError(f"{self._source}: {message} at offset {where} (file is corrupt or truncated)")

    def _take(self, count: int, what: str) -> memoryview:
        if count < 0 or self._offset + count > len(self._data):
            raise self.error(
                f"truncated data: {what} needs {count} bytes but only {len(self._data) - self._offset} remain"
            )
        chunk = self._data[self._offset : self._offset + count]
        self._offset += count
        return chunk

    def read_int(self) -> int:
        """dlib's variable-length integer: a control byte (low nibble = byte count, 0x80 = negative)
        followed by the magnitude in little-endian order."""
        start = self._offset
        control = self._take(1, "integer control byte")[0]
        size = control & 0x0F
        if control & 0x70 or size > 8:
            raise self.error(f"invalid integer control byte 0x{control:02x}", start)
        magnitude = int.from_bytes(self._take(size, "integer"), "little")
        return -magnitude if control & 0x80 else magnitude

    def read_count(self, what: str) -> int:
        """A non-negative integer (a size or dimension); negative values mean corruption."""
        start = self._offset
        value = self.read_int()
        if value < 0:
            raise self.error(f"negative {what} {value}", start)
        return value

    def read_bool(self) -> bool:
        start = self._offset
        byte = self._take(1, "boolean")[0]
        if byte == ord("1"):
            return True
        if byte == ord("0"):
            return False
        raise self.error(f"invalid boolean byte 0x{byte:02x} (expected '0' or '1')", start)

    def read_float(self) -> float:
        """Floats outside tensors are (int64 mantissa, int16 exponent): value = mantissa * 2**exponent."""
        start = self._offset
        mantissa = self.read_int()
        exponent = self.read_int()
        if not -(2**63) <= mantissa < 2**63 or not -(2**15) <= exponent < 2**15:
            raise self.error(f"float out of range (mantissa {mantissa}, exponent {exponent})", start)
        if exponent == _EXPONENT_INF:
            return math.inf
        if exponent == _EXPONENT_NEG_INF:
            return -math.inf
        if exponent == _EXPONENT_NAN:
            return math.nan
        return math.ldexp(mantissa, exponent)

    def read_string(self) -> str:
        start = self._offset
        length = self.read_count("string length")
        raw = bytes(self._take(length, "string"))
        try:
            return raw.decode("ascii")
        except UnicodeDecodeError:
            raise self.error(f"string is not ASCII: {raw[:32]!r}", start) from None

    def expect_string(self, expected: str) -> None:
        start = self._offset
        found = self.read_string()
        if found != expected:
            raise self.error(f"expected {expected!r}, found {found!r}", start)

    def read_tensor(self) -> np.ndarray:
        """A resizable_tensor: version 2, n, k, nr, nc, then n*k*nr*nc little-endian float32."""
        start = self._offset
        version = self.read_int()
        if version != _TENSOR_VERSION:
            raise self.error(f"unsupported tensor version {version} (expected {_TENSOR_VERSION})", start)
        shape = tuple(self.read_count("tensor dimension") for _ in range(4))
        count = math.prod(shape)
        # _take checks the byte count against what remains before anything is allocated.
        raw = self._take(4 * count, f"tensor of shape {shape}")
        return np.frombuffer(raw, dtype="<f4").astype(np.float32).reshape(shape)

    def read_alias_shape(self) -> tuple[int, int, int, int]:
        """An alias_tensor stores only its shape (version 1, n, k, nr, nc); the data lives in params."""
        start = self._offset
        version = self.read_int()
        if version != _ALIAS_TENSOR_VERSION:
            raise self.error(f"unsupported alias_tensor version {version}", start)
        n, k, nr, nc = (self.read_count("alias_tensor dimension") for _ in range(4))
        return n, k, nr, nc


# ---- layer records ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class InputRgbLayer:
    avg_rgb: tuple[float, float, float]  # subtracted per channel, then divided by 256
    rows: int
    cols: int
    offset: int


@dataclass(frozen=True)
class ConvLayer:
    filters: np.ndarray = field(repr=False)  # float32 [out, in, rows, cols] (OIHW)
    biases: np.ndarray | None = field(repr=False)  # float32 [out] or None
    stride: tuple[int, int]  # (y, x)
    padding: tuple[int, int]  # (y, x), symmetric
    offset: int

    @property
    def num_filters(self) -> int:
        return int(self.filters.shape[0])

    @property
    def kernel(self) -> tuple[int, int]:
        return int(self.filters.shape[2]), int(self.filters.shape[3])


@dataclass(frozen=True)
class AffineLayer:
    gamma: np.ndarray = field(repr=False)  # float32, shape of dlib's alias (1, k, 1, 1) in conv mode
    beta: np.ndarray = field(repr=False)
    conv_mode: bool
    offset: int


@dataclass(frozen=True)
class ReluLayer:
    offset: int


@dataclass(frozen=True)
class PoolLayer:
    kind: str  # "max" or "avg"
    window: tuple[int, int]  # (rows, cols); 0 means the whole input dimension
    stride: tuple[int, int]
    padding: tuple[int, int]
    offset: int


@dataclass(frozen=True)
class AddPrevLayer:
    offset: int  # the tag it adds is not stored


@dataclass(frozen=True)
class FcLayer:
    weights: np.ndarray = field(repr=False)  # float32 [inputs, outputs]: y = x @ weights (+ biases)
    biases: np.ndarray | None = field(repr=False)
    offset: int


@dataclass(frozen=True)
class PassThrough:
    """A tag or skip layer: both serialize as version 1 with no id, so they are indistinguishable."""

    offset: int


@dataclass(frozen=True)
class LossRecord:
    kind: str
    values: tuple[float, ...]
    offset: int


Layer = ConvLayer | AffineLayer | ReluLayer | PoolLayer | AddPrevLayer | FcLayer | PassThrough


@dataclass(frozen=True)
class DnnFile:
    source: str
    loss: LossRecord
    input: InputRgbLayer
    layers: tuple[Layer, ...]  # innermost (next to the input) first, tag/skip layers included


def _read_con(reader: DatReader, tag: str, offset: int) -> ConvLayer:
    params = reader.read_tensor().reshape(-1)
    num_filters = reader.read_count("num_filters")
    rows, cols = reader.read_count("filter rows"), reader.read_count("filter cols")
    stride = (reader.read_count("stride y"), reader.read_count("stride x"))
    padding = (reader.read_count("padding y"), reader.read_count("padding x"))
    filters_shape = reader.read_alias_shape()
    biases_shape = reader.read_alias_shape()
    for _ in range(4):  # learning-rate and weight-decay multipliers: training only
        reader.read_float()
    use_bias = reader.read_bool() if tag == "con_5" else True
    if filters_shape[0] != num_filters or filters_shape[2:] != (rows, cols):
        raise reader.error(f"{tag}: filter shape {filters_shape} disagrees with {num_filters}x{rows}x{cols}")
    if min(stride) < 1:
        raise reader.error(f"{tag}: stride {stride} must be positive")
    n_filter = math.prod(filters_shape)
    n_bias = math.prod(biases_shape) if use_bias else 0
    if use_bias and n_bias != num_filters:
        raise reader.error(f"{tag}: {n_bias} biases for {num_filters} filters")
    if params.size != n_filter + n_bias:
        raise reader.error(f"{tag}: params hold {params.size} values, expected {n_filter} + {n_bias}")
    filters = params[:n_filter].reshape(filters_shape)
    biases = params[n_filter:].copy() if use_bias else None
    return ConvLayer(filters=filters, biases=biases, stride=stride, padding=padding, offset=offset)


def _read_affine(reader: DatReader, tag: str, offset: int) -> AffineLayer:
    params = reader.read_tensor().reshape(-1)
    gamma_shape = reader.read_alias_shape()
    beta_shape = reader.read_alias_shape()
    mode = reader.read_int()  # dlib's layer_mode: CONV_MODE = 0, FC_MODE = 1
    if mode not in (0, 1):
        raise reader.error(f"{tag}: unknown mode {mode}")
    size = math.prod(gamma_shape)
    if beta_shape != gamma_shape or params.size != 2 * size:
        raise reader.error(f"{tag}: params of {params.size} values do not fit gamma/beta {gamma_shape}")
    gamma = params[:size].reshape(gamma_shape)
    beta = params[size:].reshape(beta_shape)
    return AffineLayer(gamma=gamma, beta=beta, conv_mode=mode == 0, offset=offset)


def _read_pool(reader: DatReader, tag: str, offset: int) -> PoolLayer:
    window = (reader.read_count("pool rows"), reader.read_count("pool cols"))
    stride = (reader.read_count("pool stride y"), reader.read_count("pool stride x"))
    padding = (reader.read_count("pool padding y"), reader.read_count("pool padding x"))
    if min(stride) < 1:
        raise reader.error(f"{tag}: stride {stride} must be positive")
    kind = "max" if tag.startswith("max") else "avg"
    return PoolLayer(kind=kind, window=window, stride=stride, padding=padding, offset=offset)


def _read_fc(reader: DatReader, tag: str, offset: int) -> FcLayer:
    num_outputs = reader.read_count("fc outputs")
    num_inputs = reader.read_count("fc inputs")
    params = reader.read_tensor().reshape(-1)
    weights_shape = reader.read_alias_shape()
    biases_shape = reader.read_alias_shape()
    bias_mode = reader.read_int()  # FC_HAS_BIAS = 0, FC_NO_BIAS = 1
    for _ in range(4):  # learning-rate and weight-decay multipliers
        reader.read_float()
    if bias_mode not in (0, 1):
        raise reader.error(f"{tag}: unknown bias mode {bias_mode}")
    if weights_shape[:2] != (num_inputs, num_outputs):
        raise reader.error(f"{tag}: weights {weights_shape} disagree with {num_inputs}x{num_outputs}")
    n_weights = num_inputs * num_outputs
    n_bias = num_outputs if bias_mode == 0 else 0
    if params.size != n_weights + n_bias or (bias_mode == 0 and math.prod(biases_shape) != n_bias):
        raise reader.error(f"{tag}: params hold {params.size} values, expected {n_weights} + {n_bias}")
    weights = params[:n_weights].reshape(num_inputs, num_outputs)
    biases = params[n_weights:].copy() if bias_mode == 0 else None
    return FcLayer(weights=weights, biases=biases, offset=offset)


def _read_relu(reader: DatReader, tag: str, offset: int) -> ReluLayer:
    return ReluLayer(offset=offset)


def _read_add_prev(reader: DatReader, tag: str, offset: int) -> AddPrevLayer:
    return AddPrevLayer(offset=offset)


_LAYER_READERS: dict[str, Callable[[DatReader, str, int], Layer]] = {
    "con_4": _read_con,
    "con_5": _read_con,
    "affine_": _read_affine,
    "relu_": _read_relu,
    "max_pool_2": _read_pool,
    "avg_pool_2": _read_pool,
    "add_prev_": _read_add_prev,
    "fc_2": _read_fc,
}

# Loss records: type string -> number of floats that follow it.
_LOSS_FLOATS = {"loss_metric_2": 2}  # margin, distance threshold


def _read_layer(reader: DatReader) -> Layer:
    offset = reader.offset
    tag = reader.read_string()
    read = _LAYER_READERS.get(tag)
    if read is None:
        raise reader.error(f"unsupported layer type {tag!r}", offset)
    return read(reader, tag, offset)


def _read_input(reader: DatReader) -> InputRgbLayer:
    offset = reader.offset
    reader.expect_string("input_rgb_image_sized")
    avg = (reader.read_float(), reader.read_float(), reader.read_float())
    rows, cols = reader.read_count("input rows"), reader.read_count("input cols")
    return InputRgbLayer(avg_rgb=avg, rows=rows, cols=cols, offset=offset)


def _skip_layer_state(reader: DatReader) -> None:
    # this_layer_setup_called, gradient_input_is_stale, get_output_and_gradient_input_disabled
    for _ in range(3):
        reader.read_bool()
    # x_grad, cached_output, params_grad (grad_final for the innermost layer): training state only
    for _ in range(3):
        reader.read_tensor()


def parse_dnn(data: bytes, source: str | Path) -> DnnFile:
    """Parse a whole serialized network; ``source`` names the file in error messages."""
    reader = DatReader(data, source)
    loss_version_at = reader.offset
    loss_version = reader.read_int()
    if loss_version != 1:
        raise reader.error(f"unsupported add_loss_layer version {loss_version}", loss_version_at)
    loss_at = reader.offset
    loss_kind = reader.read_string()
    n_floats = _LOSS_FLOATS.get(loss_kind)
    if n_floats is None:
        raise reader.error(f"unsupported loss layer {loss_kind!r}", loss_at)
    loss = LossRecord(loss_kind, tuple(reader.read_float() for _ in range(n_floats)), loss_at)

    # Wrapper versions, outermost first, until the innermost add_layer (version 3) over the input.
    wrappers: list[tuple[int, int]] = []
    while True:
        at = reader.offset
        version = reader.read_int()
        if version == 3:
            break
        if version not in (1, 2):
            raise reader.error(f"unexpected layer wrapper version {version}", at)
        wrappers.append((version, at))

    input_layer = _read_input(reader)
    layers: list[Layer] = [_read_layer(reader)]
    _skip_layer_state(reader)
    reader.read_int()  # _sample_expansion_factor of the input layer

    for version, at in reversed(wrappers):
        if version == 1:
            layers.append(PassThrough(offset=at))
        else:
            layers.append(_read_layer(reader))
            _skip_layer_state(reader)
    if not reader.at_end():
        raise reader.error("unexpected trailing data after the network")
    return DnnFile(source=reader.source, loss=loss, input=input_layer, layers=tuple(layers))


def read_dnn(path: Path) -> DnnFile:
    return parse_dnn(path.read_bytes(), path)
