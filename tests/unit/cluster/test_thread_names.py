"""OS thread names: what `top -H` and the CPU split show for kvmesh's threads."""

from __future__ import annotations

import threading

from kvmesh.cluster import thread_names


def test_a_name_is_cut_to_what_linux_keeps():
    got = {}

    def run() -> None:
        got["ok"] = thread_names.name_this_thread("kvmesh-a-very-long-thread-name")
        got["name"] = thread_names.os_thread_name(threading.get_native_id())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert got == {"ok": True, "name": "kvmesh-a-very-l"}


def test_a_handlers_thread_is_named_once_and_keeps_a_later_name():
    """Handlers call `name_loop_thread` on every request: the first names the thread, later calls do
    nothing (so a thread renamed since keeps its name, and the call costs a set lookup)."""
    got = {}

    def run() -> None:
        thread_names.name_loop_thread()
        got["first"] = thread_names.os_thread_name(threading.get_native_id())
        thread_names.name_this_thread("renamed")
        thread_names.name_loop_thread()
        got["later"] = thread_names.os_thread_name(threading.get_native_id())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert got == {"first": "kvmesh-loop", "later": "renamed"}


def test_a_thread_that_is_not_there_has_no_name():
    assert thread_names.os_thread_name(threading.get_native_id()) is not None
    assert thread_names.os_thread_name(2**31 - 1) is None  # above any pid_max
