"""cpu/huge_pages.py: the whole 2 MB pages inside the weights' memory move into huge pages, their values kept,
and nothing is asked for where Linux's transparent huge pages are off."""

import ctypes
import errno
import os

import pytest
import torch

from minfer.cpu import huge_pages
from minfer.cpu.huge_pages import HUGE_PAGE, in_huge_pages, memory_ranges


def huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping that holds `address`, from /proc/self/smaps (kB -> bytes)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split()[0]
            if "-" in first and not first.endswith(":"):
                start, end = (int(x, 16) for x in first.split("-"))
                inside = start <= address < end
            elif inside and first == "AnonHugePages:":
                return int(line.split()[1]) * 1024
    return 0


def collapse_works() -> str | None:
    """Why this machine cannot move memory into huge pages now, or None."""
    if not os.path.exists(huge_pages.SETTING):
        return "no transparent huge pages here (not Linux, or a kernel without them)"
    if "[never]" in huge_pages.SETTING.read_text():
        return "transparent huge pages are `never` on this machine"
    if tuple(int(x) for x in os.uname().release.split(".")[:2] if x.isdigit()) < (6, 1):
        return "MADV_COLLAPSE needs Linux 6.1"
    return None


def test_ranges_are_the_storages_with_neighbours_merged():
    big = torch.zeros(1 << 20)  # 4 MB
    a, b = big[: 1 << 18], big[1 << 19 :]  # views: the whole storage counts once
    start = big.untyped_storage().data_ptr()
    assert memory_ranges([a, b, big]) == [(start, start + (4 << 20))]
    memory = bytearray(64 << 10)  # tensors at chosen offsets in one buffer: 100 bytes apart, then 8 KB
    near, next_to_it, far = (torch.frombuffer(memory, dtype=torch.uint8, count=1000, offset=at)
                             for at in (0, 1100, 10100))
    base = near.data_ptr()
    assert memory_ranges([far, next_to_it, near]) == [(base, base + 2100), (base + 10100, base + 11100)]
    assert memory_ranges([torch.zeros(0), big.to_mkldnn()]) == []  # nothing to read: an empty or opaque tensor


@pytest.mark.skipif(collapse_works() is not None, reason=str(collapse_works()))
def test_the_whole_pages_inside_a_weight_move_and_keep_their_values():
    weight = torch.randn(6 << 20 >> 2)  # 6 MB of fp32: two or three whole 2 MB pages inside, as it is aligned
    want = weight.clone()
    start = weight.untyped_storage().data_ptr()
    whole = ((start + weight.nbytes) // HUGE_PAGE - -(-start // HUGE_PAGE)) * HUGE_PAGE
    moved = in_huge_pages([weight])
    assert moved == whole >= 2 * HUGE_PAGE
    assert huge_bytes_at(-(-start // HUGE_PAGE) * HUGE_PAGE) >= moved
    assert torch.equal(weight, want)


@pytest.mark.parametrize("failures, error, moved, calls", [
    (2, errno.EAGAIN, True, 3),  # transient (a page locked or moving, as the kernel's scanners do): tried again
    (3, errno.EAGAIN, False, 3),  # three times at most
    (1, errno.EINVAL, False, 1),  # memory that cannot take huge pages: not tried again
])
def test_a_collapse_the_kernel_calls_transient_is_tried_again(failures, error, moved, calls):
    """CI once found 0 bytes moved where 4 MB could be: MADV_COLLAPSE fails now and then with EAGAIN."""
    called = []

    def madvise(start, length, advice):
        called.append(advice)
        if len(called) <= failures:
            ctypes.set_errno(error)
            return -1
        return 0

    assert huge_pages._collapse(madvise, 0, HUGE_PAGE) is moved and len(called) == calls


def test_a_weight_smaller_than_a_huge_page_is_left_alone():
    assert in_huge_pages([torch.randn(1000)]) == 0


def test_nothing_is_asked_where_huge_pages_are_never(tmp_path, monkeypatch):
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "SETTING", setting)
    huge_pages._madvise.cache_clear()
    try:
        assert in_huge_pages([torch.randn(6 << 20 >> 2)]) == 0
    finally:
        huge_pages._madvise.cache_clear()


@pytest.mark.skipif(collapse_works() is not None, reason=str(collapse_works()))
def test_soon_moves_them_on_a_thread_of_its_own():
    weight = torch.randn(6 << 20 >> 2)
    want = weight.clone()
    huge_pages.in_huge_pages_soon([weight]).join(30)
    start = -(-weight.untyped_storage().data_ptr() // HUGE_PAGE) * HUGE_PAGE
    assert huge_bytes_at(start) >= 2 * HUGE_PAGE and torch.equal(weight, want)


@pytest.mark.skipif(collapse_works() is not None, reason=str(collapse_works()))
def test_a_huge_page_tensor_is_in_huge_pages_from_its_first_write():
    t = huge_pages.huge_page_tensor(6 << 20 >> 2).fill_(2.0)  # 6 MB, its start on a 2 MB boundary
    assert t.data_ptr() % HUGE_PAGE == 0 and t.numel() == 6 << 20 >> 2 and bool((t == 2).all())
    assert huge_bytes_at(t.data_ptr()) >= 2 * HUGE_PAGE  # (the kernel may leave the last page small)
