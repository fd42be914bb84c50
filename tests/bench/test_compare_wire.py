"""``bench compare`` talks to etcd's gRPC services with protobuf messages it encodes itself."""

from __future__ import annotations

from bench.compare_sides import _pb


def test_the_etcd_messages_use_protobufs_wire_format() -> None:
    # protobuf's own documented examples: field 1 = 150 is 08 96 01; a string field 2 = "testing".
    assert _pb.message((1, 150)) == bytes.fromhex("089601")
    assert _pb.message((2, b"testing")) == bytes.fromhex("120774657374696e67")
    lock = _pb.message((1, b"doc:1"), (2, 7587869452581237000))  # LockRequest{name, lease}
    assert _pb.fields(lock) == {1: b"doc:1", 2: 7587869452581237000}
    # An int64 below zero is ten bytes of two's complement, read back as its unsigned form.
    assert len(_pb.message((1, -1))) == 11 and _pb.fields(_pb.message((1, -1))) == {1: 2**64 - 1}
    # A response with a nested header (field 1) and the key (field 2): the key is what Unlock takes.
    header = _pb.message((1, 14841639068965178418), (3, 42))
    response = _pb.message((1, header), (2, b"doc:1/694d7b5e"))
    assert _pb.fields(response)[2] == b"doc:1/694d7b5e" and _pb.fields(_pb.fields(response)[1])[3] == 42
