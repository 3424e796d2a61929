"""The catch-up wire's checksum (ft/transfer.py): CRC32C, named in the manifest.

The digests are CRC32C (Castagnoli) of each chunk's bytes as they lie back to back, the
padding between tensors included; a manifest that names another algorithm, or none, is
refused before anything is fetched; a chunk whose bytes differ from the digest is refused
by the joiner, and the transfer goes on from a source that serves it right. A fetch
worker keeps its connection from chunk to chunk; one the source closed while idle is
opened again.
"""

from __future__ import annotations

import json
import time

import google_crc32c
import pytest
import torch

from transom.errors import WireError
from transom.ft import transfer
from transom.ft.state_server import StateServer


def _published(chunk_bytes: int = 256) -> transfer.Published:
    torch.manual_seed(0)
    tensors = {"a": torch.randn(100), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(3, 5)}
    skeleton = {k: {"__tensor__": k} for k in tensors}
    return transfer.publish(4, tensors, skeleton, chunk_bytes=chunk_bytes)


def _served_bytes(p: transfer.Published) -> bytes:
    return b"".join(bytes(piece) for i in range(len(p.manifest.digests)) for piece in p.chunk(i))


def test_the_digests_are_crc32c_of_each_chunk_and_the_manifest_names_it():
    assert transfer.digest([memoryview(b"123456789")]) == 0xE3069283  # CRC32C's check value
    p = _published()
    assert p.manifest.checksum == "crc32c" and json.loads(p.manifest_json)["checksum"] == "crc32c"
    data = _served_bytes(p)
    assert len(data) == p.manifest.total_bytes
    size = p.manifest.chunk_bytes
    assert p.manifest.digests == [google_crc32c.value(data[i:i + size]) for i in range(0, len(data), size)]
    # Pieces are digested where they lie: split anywhere, the same value
    assert transfer.digest([memoryview(data[:5]), memoryview(b""), memoryview(data[5:size])]) \
        == p.manifest.digests[0]


@pytest.mark.parametrize("name", ["crc32", "CRC32C", "sha256", "", None, 1])
def test_a_manifest_naming_another_checksum_is_refused(name):
    body = json.loads(_published().manifest_json)
    body["checksum"] = name
    with pytest.raises(WireError):
        transfer.parse_manifest(json.dumps(body).encode())
    del body["checksum"]
    with pytest.raises(WireError):
        transfer.parse_manifest(json.dumps(body).encode())


def test_a_corrupt_chunk_is_detected_and_taken_from_an_honest_source():
    good, bad = _published(), _published()
    bad.views[1][3] ^= 0x01  # one bit of the second tensor, in the same manifest
    assert bad.manifest_json == good.manifest_json
    servers = [StateServer("tok"), StateServer("tok")]
    try:
        servers[0].publish_snapshot(bad)
        manifest = transfer.parse_manifest(bad.manifest_json)
        with pytest.raises(WireError, match="checksum mismatch"):
            transfer.fetch(manifest, [servers[0].url], "tok", 5.0)
        servers[1].publish_snapshot(good)
        data = transfer.fetch(manifest, [servers[0].url, servers[1].url], "tok", 5.0)
        assert bytes(data) == _served_bytes(good)
    finally:
        for s in servers:
            s.close()


def test_a_kept_connection_the_source_closed_when_idle_is_opened_again():
    p = _published()
    server = StateServer("tok", idle_timeout_s=0.2)
    link = transfer._Link(server.url, "tok", 5.0)
    try:
        server.publish_snapshot(p)
        manifest = transfer.parse_manifest(p.manifest_json)
        data = bytearray(manifest.total_bytes)
        for i in range(len(manifest.digests)):
            if i == 1:
                time.sleep(0.6)  # the server drops the idle connection meanwhile
            start, end = manifest.chunk_range(i)
            link.chunk_into(manifest, i, memoryview(data)[start:end])
        assert bytes(data) == _served_bytes(p)
    finally:
        link.close()
        server.close()
