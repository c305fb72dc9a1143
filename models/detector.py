"""YuNet face detection on ONNX Runtime, batched, with our own decoding and NMS.

The shipped YuNet graph has a fixed input [1, 3, 640, 640]. We rewrite it in memory so that batch, height
and width are symbolic: the only batch-bound nodes are the head's Reshapes to [1, -1, C], which become
[0, -1, C] (0 = copy the input's dimension). Everything else (Conv, MaxPool, Resize by scales) is shape
agnostic. The file's weight dequantisation is folded to float at load (ONNX Runtime 1.30 rejects its
single-block quantisation attributes). The model takes BGR 0-255 float input with no normalisation.
The service loads the file model_build.yunet converts from this once at build time (weights float, uint8
input); FaceDetector takes either.

Letterboxing shrinks a face that fills the frame and pushes it against the border, where YuNet (trained
on whole scenes) misses it; padding the image on every side before letterboxing restores those faces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import onnx
from onnx import numpy_helper

from models.arrays import to_rgb
from models.errors import ModelFormatError
from models.sessions import SessionOptions, SessionRunner, create_session, fixed_run_size, run_padded
from models.types import DetectedFace

STRIDES: tuple[int, ...] = (8, 16, 32)
INPUT_NAME = "input"
_HEADS = ("cls", "obj", "bbox", "kps")


@dataclass(frozen=True)
class DetectorOptions:
    input_size: int = 640  # square network input; a multiple of the largest stride (32)
    # Dev-set scores (pad_ratio 0.2): real faces >= 0.82 (tight age crops 0.82, identity 0.91, group
    # faces 0.90); non-faces reach 0.57 (a coffee cup from above), 0.62 on a crop of a galaxy field and up
    # to 0.76 at other pad ratios. 0.7 sits between the two; faces under ~10 network pixels score
    # 0.6-0.75 and are partly lost, which the service (largest face of a portrait) can afford.
    score_threshold: float = 0.7
    nms_threshold: float = 0.3
    min_face_size: int = 20  # smaller side of the box, in original-image pixels
    # Border on every side, as a fraction of the image's longer side, before letterboxing. Tight 200 px
    # crops: best score of the weakest of 60 is 0.59 with no pad, 0.71 at 0.1, 0.82 at 0.2, 0.88 at 0.25;
    # the cost is resolution for small faces (tiled group photos lose faces from 0.25-0.3 on).
    pad_ratio: float = 0.2
    top_k: int = 50  # most faces kept per image, highest scores first
    # Images per inference on CPU: one at a time costs 9 ms of CPU per 640 px image against 15 ms in runs of
    # 16 (the activations of 16 images overflow the CPU's caches), same faces. A GPU runs gpu_run_size.
    cpu_images_per_run: int = 1

    def __post_init__(self) -> None:
        if self.input_size <= 0 or self.input_size % max(STRIDES) != 0:
            raise ValueError(
                f"input_size must be a positive multiple of {max(STRIDES)}, got {self.input_size}"
            )
        if not 0.0 <= self.score_threshold <= 1.0:
            raise ValueError(f"score_threshold must be in [0, 1], got {self.score_threshold}")
        if not 0.0 < self.nms_threshold <= 1.0:
            raise ValueError(f"nms_threshold must be in (0, 1], got {self.nms_threshold}")
        if self.min_face_size < 0 or self.pad_ratio < 0 or self.top_k <= 0:
            raise ValueError("min_face_size and pad_ratio must be >= 0 and top_k > 0")
        if self.cpu_images_per_run <= 0:
            raise ValueError(f"cpu_images_per_run must be > 0, got {self.cpu_images_per_run}")


@dataclass(frozen=True)
class LetterboxedImage:
    """A network-ready image. This crosses process boundaries, so it is stored as uint8 (a quarter of
    float32) and converted to float in detect_prepared."""

    tensor: np.ndarray  # uint8 [3, S, S], BGR, the letterboxed image centred on a black canvas
    scale: float  # network pixels per original pixel
    pad_x: float  # offset of the original image's left edge on the canvas, network pixels
    pad_y: float
    original_size: tuple[int, int]  # (height, width) of the original image


def dequantize_constant(
    values: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None, axis: int, block_size: int
) -> np.ndarray:
    """DequantizeLinear (opset 21) on constants: (x - zero_point) * scale, per tensor, axis or block."""
    scale = scale.astype(np.float32)
    zero = np.zeros_like(scale) if zero_point is None else zero_point.astype(np.float32)
    axis = axis % values.ndim
    if block_size > 0:
        # Blocked: scale has the input's rank; each entry covers block_size elements along `axis`.
        size = values.shape[axis]
        scale = np.repeat(scale, block_size, axis=axis).take(np.arange(size), axis=axis)
        zero = np.repeat(zero, block_size, axis=axis).take(np.arange(size), axis=axis)
    elif scale.size > 1:
        shape = [1] * values.ndim
        shape[axis] = -1
        scale, zero = scale.reshape(shape), zero.reshape(shape)
    else:
        scale, zero = scale.reshape(()), zero.reshape(())
    scaled: np.ndarray = ((values.astype(np.float32) - zero) * scale).astype(np.float32)
    return scaled


def _fold_weight_dequantization(graph: onnx.GraphProto) -> int:
    """Replace DequantizeLinear nodes on constant weights by float initializers; return how many.

    The shipped int8bq file stores single-block "blocked" quantisation (e.g. a scale of shape [1] for a
    [64] bias with block_size=64). That is valid ONNX, but ONNX Runtime 1.30 rejects it ("block_size must
    be 0 for per-tensor quantization"), so the unmodified file does not run. Activations are float
    anyway, so dequantising the weights once at load changes nothing numerically.
    """
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    kept_nodes = []
    folded = 0
    for node in graph.node:
        inputs = [name for name in node.input if name]
        if node.op_type != "DequantizeLinear" or not all(name in initializers for name in inputs):
            kept_nodes.append(node)
            continue
        attrs = {attr.name: attr.i for attr in node.attribute}
        arrays = [numpy_helper.to_array(initializers[name]) for name in inputs]
        values = dequantize_constant(
            arrays[0],
            arrays[1],
            arrays[2] if len(arrays) > 2 else None,
            attrs.get("axis", 1),
            attrs.get("block_size", 0),
        )
        graph.initializer.append(numpy_helper.from_array(values, node.output[0]))
        folded += 1
    del graph.node[:]
    graph.node.extend(kept_nodes)
    # Drop initializers no node reads any more (also silences ONNX Runtime's warnings about the file's own).
    used = {name for node in graph.node for name in node.input}
    kept_initializers = [tensor for tensor in graph.initializer if tensor.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept_initializers)
    return folded


def _make_batch_symbolic(graph: onnx.GraphProto) -> None:
    """Turn the head's Reshapes to [1, -1, C] into [0, -1, C] and make batch, height, width symbolic."""
    # Tensors computed from the image (as opposed to weights, whose Reshapes must stay as they are).
    from_input = {graph.input[0].name}
    for node in graph.node:
        if any(name in from_input for name in node.input):
            from_input.update(node.output)

    initializers = {tensor.name: tensor for tensor in graph.initializer}
    patched_shapes: set[str] = set()
    for node in graph.node:
        if node.op_type != "Reshape" or node.input[0] not in from_input:
            continue
        if any(attr.name == "allowzero" and attr.i != 0 for attr in node.attribute):
            raise ModelFormatError(f"Reshape {node.name} uses allowzero=1; cannot make its batch symbolic")
        shape_name = node.input[1]
        if shape_name in patched_shapes:
            continue
        if shape_name not in initializers:
            raise ModelFormatError(f"Reshape {node.name} has a computed shape; expected a constant")
        shape = numpy_helper.to_array(initializers[shape_name]).copy()
        if shape.ndim != 1 or shape.size == 0 or shape[0] != 1:
            raise ModelFormatError(f"Reshape {node.name} has shape {shape.tolist()}; expected [1, -1, C]")
        shape[0] = 0  # copy the batch dimension from the input tensor
        initializers[shape_name].CopyFrom(numpy_helper.from_array(shape, shape_name))
        patched_shapes.add(shape_name)
    if not patched_shapes:
        raise ModelFormatError("found no batch-bound Reshape in the YuNet graph; is this the right file?")

    input_dims = graph.input[0].type.tensor_type.shape.dim
    for dim, name in zip(input_dims, ("batch", None, "height", "width"), strict=True):
        if name is not None:
            dim.Clear()
            dim.dim_param = name
    for output in graph.output:
        dims = output.type.tensor_type.shape.dim
        dims[0].Clear()
        dims[0].dim_param = "batch"
        dims[1].Clear()
        dims[1].dim_param = f"anchors_{output.name}"
    # Recorded intermediate shapes hold the old fixed sizes; let ONNX Runtime infer them again.
    del graph.value_info[:]


def make_runnable(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of the shipped YuNet graph that ONNX Runtime can run with any batch and input size."""
    patched = onnx.ModelProto()
    patched.CopyFrom(model)
    graph = patched.graph
    if len(graph.input) != 1 or graph.input[0].name != INPUT_NAME:
        raise ModelFormatError(f"YuNet graph should have one input named {INPUT_NAME!r}")
    _fold_weight_dequantization(graph)
    _make_batch_symbolic(graph)
    return patched


def _nms(boxes: np.ndarray, scores: np.ndarray, iou_threshold: float, limit: int) -> np.ndarray:
    """Greedy non-maximum suppression; indices of kept boxes, highest score first, at most `limit`."""
    order = np.argsort(-scores, kind="stable")
    areas = np.maximum(boxes[:, 2] - boxes[:, 0], 0) * np.maximum(boxes[:, 3] - boxes[:, 1], 0)
    keep: list[int] = []
    while order.size > 0 and len(keep) < limit:
        best = int(order[0])
        keep.append(best)
        rest = order[1:]
        inter_w = np.maximum(
            np.minimum(boxes[best, 2], boxes[rest, 2]) - np.maximum(boxes[best, 0], boxes[rest, 0]), 0
        )
        inter_h = np.maximum(
            np.minimum(boxes[best, 3], boxes[rest, 3]) - np.maximum(boxes[best, 1], boxes[rest, 1]), 0
        )
        inter = inter_w * inter_h
        union = areas[best] + areas[rest] - inter
        iou = np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)
        order = rest[iou <= iou_threshold]
    return np.asarray(keep, dtype=np.int64)


def letterbox(image: np.ndarray, options: DetectorOptions) -> LetterboxedImage:
    """Pad, scale (keeping aspect) and centre the image on a black SxS canvas, as BGR uint8 CHW."""
    rgb = to_rgb(image)
    height, width = rgb.shape[:2]
    size = options.input_size
    scale = size / (max(height, width) * (1.0 + 2.0 * options.pad_ratio))
    # Passing fx/fy (not dsize) makes OpenCV map coordinates by exactly `scale` on both axes.
    if round(width * scale) >= 1 and round(height * scale) >= 1:
        interpolation = cv2.INTER_AREA if scale < 1.0 else cv2.INTER_LINEAR
        resized = cv2.resize(rgb, None, fx=scale, fy=scale, interpolation=interpolation)
    else:  # a degenerate strip of pixels; no face can be in it, keep one row/column
        dsize = (max(1, round(width * scale)), max(1, round(height * scale)))
        resized = cv2.resize(rgb, dsize, interpolation=cv2.INTER_AREA)
    resized = resized[:size, :size]
    new_h, new_w = resized.shape[:2]
    pad_x, pad_y = (size - new_w) // 2, (size - new_h) // 2
    canvas = np.zeros((3, size, size), dtype=np.uint8)
    canvas[:, pad_y : pad_y + new_h, pad_x : pad_x + new_w] = resized[:, :, ::-1].transpose(2, 0, 1)
    return LetterboxedImage(
        tensor=canvas, scale=scale, pad_x=float(pad_x), pad_y=float(pad_y), original_size=(height, width)
    )


class FaceDetector(SessionRunner):
    def __init__(self, model_path: Path, options: DetectorOptions, session_options: SessionOptions) -> None:
        self.options = options
        try:
            model = onnx.load(str(model_path))
        except Exception as error:
            raise ModelFormatError(f"cannot read YuNet ONNX file {model_path}: {error}") from error
        size = options.input_size
        # The converted file (model_build.yunet) takes the uint8 letterbox as it is; the shipped one is made
        # runnable here and takes float.
        takes_uint8 = model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.UINT8
        self._input_dtype: type[np.generic] = np.uint8 if takes_uint8 else np.float32
        runnable = model if takes_uint8 else make_runnable(model)
        warmup = {INPUT_NAME: np.zeros((1, 3, size, size), dtype=self._input_dtype)}
        self._session = create_session(runnable.SerializeToString(), session_options, warmup)
        self._output_names = [f"{head}_{stride}" for head in _HEADS for stride in STRIDES]
        on_cpu = self._session.get_providers()[0] == "CPUExecutionProvider"
        self.images_per_run = options.cpu_images_per_run if on_cpu else None  # None: the whole batch
        self._run_size = fixed_run_size(self._session, session_options)
        # Grid cell coordinates of every anchor, strides concatenated in the order of the outputs.
        xs, ys, ss = [], [], []
        for stride in STRIDES:
            cells = size // stride
            row, col = np.divmod(np.arange(cells * cells, dtype=np.float32), np.float32(cells))
            xs.append(col)
            ys.append(row)
            ss.append(np.full(cells * cells, stride, dtype=np.float32))
        self._grid_x = np.concatenate(xs)
        self._grid_y = np.concatenate(ys)
        self._stride = np.concatenate(ss)

    def prepare(self, image: np.ndarray) -> LetterboxedImage:
        return letterbox(image, self.options)

    def detect_prepared(self, batch: Sequence[LetterboxedImage]) -> list[list[DetectedFace]]:
        """Run the batch (in runs of images_per_run images on CPU, at once on a GPU) and decode each image's
        faces, best first."""
        if len(batch) == 0:
            return []
        size = self.options.input_size
        for item in batch:
            if item.tensor.shape != (3, size, size) or item.tensor.dtype != np.uint8:
                raise ValueError(
                    f"expected a uint8 tensor of shape (3, {size}, {size}) from this detector's prepare(), "
                    f"got {item.tensor.dtype} {item.tensor.shape}"
                )
        step = self.images_per_run or len(batch)
        runs = [self._run(batch[start : start + step]) for start in range(0, len(batch), step)]
        heads = {head: np.concatenate([run[head] for run in runs]) for head in _HEADS}
        # Both heads are sigmoid outputs; clip guards the sqrt against tiny quantisation excursions.
        scores = np.sqrt(np.clip(heads["cls"][..., 0], 0, 1) * np.clip(heads["obj"][..., 0], 0, 1))
        return [
            self._decode(scores[i], heads["bbox"][i], heads["kps"][i], item) for i, item in enumerate(batch)
        ]

    def detect(self, images: Sequence[np.ndarray]) -> list[list[DetectedFace]]:
        return self.detect_prepared([self.prepare(image) for image in images])

    def check(self) -> None:
        """One tiny run (a health check); raises what a broken session raises."""
        self.detect([np.zeros((64, 64, 3), dtype=np.uint8)])

    def _run(self, batch: Sequence[LetterboxedImage]) -> dict[str, np.ndarray]:
        """One inference: each head's outputs for every anchor, strides concatenated, [N, anchors, C]."""
        # Converted (for the shipped file) while copied into the batch: no uint8 stack in between.
        inputs = np.empty((len(batch), *batch[0].tensor.shape), dtype=self._input_dtype)
        for row, item in zip(inputs, batch, strict=True):
            row[...] = item.tensor
        outputs = dict(
            zip(
                self._output_names,
                run_padded(self._session, self._output_names, INPUT_NAME, inputs, self._run_size),
                strict=True,
            )
        )
        return {
            head: np.concatenate([outputs[f"{head}_{stride}"] for stride in STRIDES], axis=1)
            for head in _HEADS
        }

    def _decode(
        self, scores: np.ndarray, bbox: np.ndarray, kps: np.ndarray, item: LetterboxedImage
    ) -> list[DetectedFace]:
        opts = self.options
        idx = np.flatnonzero(scores >= opts.score_threshold)
        if idx.size == 0:
            return []
        stride, gx, gy = self._stride[idx], self._grid_x[idx], self._grid_y[idx]
        # Anchor-free: centre = (cell + offset) * stride, size = exp(log-size) * stride.
        cx = (gx + bbox[idx, 0]) * stride
        cy = (gy + bbox[idx, 1]) * stride
        half_w = np.exp(bbox[idx, 2]) * stride / 2
        half_h = np.exp(bbox[idx, 3]) * stride / 2
        boxes = np.stack([cx - half_w, cy - half_h, cx + half_w, cy + half_h], axis=1)
        points = kps[idx].reshape(-1, 5, 2)
        points = (points + np.stack([gx, gy], axis=1)[:, None, :]) * stride[:, None, None]

        # Back to original pixels: undo the centring offset, then the scale.
        offset = np.array([item.pad_x, item.pad_y], dtype=np.float32)
        boxes = (boxes - np.tile(offset, 2)) / item.scale
        points = (points - offset) / item.scale

        # Size filter before NMS so a rejected small box cannot suppress anything.
        sides = np.minimum(boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1])
        big = sides >= opts.min_face_size
        boxes, points, kept_scores = boxes[big], points[big], scores[idx][big]
        keep = _nms(boxes, kept_scores, opts.nms_threshold, opts.top_k)

        height, width = item.original_size
        limits = np.array([width, height], dtype=np.float32)
        faces = []
        for i in keep:
            box = np.clip(boxes[i].reshape(2, 2), 0, limits).reshape(4).astype(np.float32)
            landmarks = np.clip(points[i], 0, limits).astype(np.float32)
            faces.append(DetectedFace(box=box, landmarks=landmarks, score=float(kept_scores[i])))
        return faces
