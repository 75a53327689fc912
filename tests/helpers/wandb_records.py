"""Reading a wandb run's offline .wandb file (its record framing), for the wandb tests of both tiers."""

from __future__ import annotations

import json
import struct
import time

WANDB_HEADER = 7  # ":W&B", a 2-byte magic, a version byte
BLOCK = 32768  # then LevelDB's log format: 32 KiB blocks of (crc32, length, type) + payload records
RECORD_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_wandb_records(path: str):
    """The protobuf records of a ``run-*.wandb`` transaction log (wandb no longer ships a reader)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, pending = WANDB_HEADER, b""
    while pos + RECORD_HEADER <= len(data):
        if BLOCK - pos % BLOCK < RECORD_HEADER:  # block trailer too small for a header: padding
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        if pos + RECORD_HEADER + length > len(data):  # still being written
            break
        chunk = data[pos + RECORD_HEADER : pos + RECORD_HEADER + length]
        pos += RECORD_HEADER + length
        if kind == 0 and length == 0:
            break
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def wait_for_exit_record(path: str, timeout: float = 30.0) -> str:
    """wandb's service process may still be writing the log when ``finish()`` returns."""
    deadline = time.time() + timeout
    while not any(r.WhichOneof("record_type") == "exit" for r in read_wandb_records(path)):
        assert time.time() < deadline, f"{path}: no exit record after {timeout}s"
        time.sleep(0.2)
    return path


def wandb_history(path: str):
    """{(name, step): value} from the run's history records."""
    out = {}
    for record in read_wandb_records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        step = items.pop("_step")
        out.update({(k, step): v for k, v in items.items() if not k.startswith("_")})
    return out
