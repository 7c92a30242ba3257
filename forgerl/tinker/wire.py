"""Tinker's protobuf wire format (the SDK's own `tinker.proto.tinker_public_pb2`): the
forward_backward request in, ForwardBackwardOutput and SampleResponse out (the SDK accepts only
protobuf for those two results). Tokens travel as int32 bytes, tensors as dense bytes of
float32 or int64 with a shape; a sparse CSR tensor is densified.
"""

from __future__ import annotations

import numpy as np
import zstandard
from tinker.proto import tinker_public_pb2 as pb

from forgerl.tinker.sampling import Sequence_
from forgerl.tinker.service import Datum, TinkerError

_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


def _tensor(msg: pb.Tensor) -> np.ndarray:
    if msg.dtype not in _NUMPY:
        raise TinkerError(f"tensor dtype {msg.dtype} is not served (float32, int64, int32)")
    dtype = _NUMPY[msg.dtype]
    if msg.HasField("sparse_csr"):
        shape = list(msg.shape)
        dense = np.zeros(shape, dtype=dtype).reshape(shape[0], -1)
        values = np.frombuffer(msg.sparse_csr.values, dtype=dtype)
        crow = np.frombuffer(msg.sparse_csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(msg.sparse_csr.col_indices, dtype=np.int64)
        for row in range(len(crow) - 1):
            dense[row, col[crow[row]:crow[row + 1]]] = values[crow[row]:crow[row + 1]]
        return dense.reshape(shape)
    return np.frombuffer(msg.dense, dtype=dtype).reshape(list(msg.shape) or -1)


def forward_backward_request(body: bytes, encoding: str | None
                             ) -> tuple[str, list[Datum], str, dict[str, float], bool]:
    """(model_id, data, loss_fn, loss_fn_config, forward_only) of a protobuf request body
    (zstd-compressed when `encoding` is "zstd"). Raises TinkerError for a body that is not one,
    or for a non-text model input (images, audio)."""
    try:
        if encoding == "zstd":
            body = zstandard.ZstdDecompressor().decompress(body, max_output_size=1 << 31)
        msg = pb.ForwardBackwardRequest()
        msg.ParseFromString(body)
    except Exception as exc:  # DecodeError, ZstdError
        raise TinkerError(f"forward_backward body is not a ForwardBackwardRequest: {exc}") from exc
    data = []
    for datum in msg.data:
        tokens: list[int] = []
        for chunk in datum.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text" and chunk.ListFields():
                raise TinkerError("only text model inputs (encoded_text chunks) are served")
            tokens += np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()
        data.append(Datum(tokens, {k: _tensor(v) for k, v in datum.loss_fn_inputs.items()}))
    config = {k: v.number for k, v in msg.loss_fn_config_v2.items() if v.HasField("number")}
    config |= {k: v for k, v in msg.loss_fn_config.items() if k not in config}
    return msg.model_id, data, msg.loss_fn, config, msg.forward_only


def forward_backward_output(logprobs: list[np.ndarray], metrics: dict[str, float]) -> bytes:
    """A ForwardBackwardOutput: one ArrayRecord whose field "logprobs" holds each datum's
    target logprobs (float32), and the metrics."""
    offsets = np.cumsum([0] + [a.nbytes for a in logprobs]).astype(np.int64)
    field = pb.BatchedTensor(data=b"".join(a.astype(np.float32).tobytes() for a in logprobs),
                             offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32)
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(logprobs),
                            fields={"logprobs": field})
    return pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record],
                                    metrics=metrics).SerializeToString()


def sample_response(seqs: list[Sequence_], prompt_logprobs: np.ndarray | None) -> bytes:
    """A SampleResponse: tokens int32, logprobs float32, prompt logprobs (NaN = none)."""
    stop = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    msg = pb.SampleResponse(sequences=[
        pb.SampledSequence(stop_reason=stop[s.stop_reason],
                           tokens=np.asarray(s.tokens, dtype=np.int32).tobytes(),
                           logprobs=np.asarray(s.logprobs, dtype=np.float32).tobytes())
        for s in seqs])
    if prompt_logprobs is not None:
        msg.prompt_logprobs = prompt_logprobs.astype(np.float32).tobytes()
    return msg.SerializeToString()
