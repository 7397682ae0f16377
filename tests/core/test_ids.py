"""Minted ids: uuid4-shaped hex, unique, and not shared with a forked child."""

from __future__ import annotations

import os
import re

from core.ids import new_id


def test_ids_are_32_lowercase_hex_digits_and_do_not_repeat() -> None:
    ids = [new_id() for _ in range(20_000)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    assert len(set(ids)) == len(ids)


def test_a_forked_child_mints_other_ids_than_its_parent() -> None:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report the next id and leave without running the parent's cleanup
        os.write(write_end, new_id().encode())
        os._exit(0)
    os.close(write_end)
    child_id = os.read(read_end, 64).decode()
    os.waitpid(pid, 0)
    os.close(read_end)
    assert re.fullmatch(r"[0-9a-f]{32}", child_id)
    assert child_id != new_id()
