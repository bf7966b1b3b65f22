"""shared_constants.py's rule on stand-in runners: a constant of the sharer is pointed at an equal one of the
owner's (same bytes, dtype, shape and strides, aligned as a package can count on), any other keeps a copy of its
own, and a package whose constants cannot be told apart stays as it was; where every one had an equal, a record
says which, and a later load reads none of its own.
The real packages share in test_compiled_step.py (test_the_whole_forward_is_packaged_once_and_loaded_after)."""

import json

import torch

from minfer.compiled.shared_constants import (
    ALIGNMENT, PackageRunner, attach_constants, share_constants,
)


class StandInRunner:
    """AOTInductor's CPU runner as share_constants uses it: constants by name and source, the buffer swap."""

    def __init__(self, constants: dict[str, torch.Tensor], sources: dict[str, str] | None = None, apart=False):
        self.active, self.inactive = ({} if apart else dict(constants)), None
        self.own = dict(constants)  # a package whose constants are `apart` reads them from its file when asked
        self.sources = sources or {name: name for name in constants}
        self.calls = []

    def get_constant_names_to_original_fqns(self):
        return dict(self.sources)

    def extract_constants_map(self, use_inactive):
        return {self.sources[name]: tensor for name, tensor in self.active.items()}

    def update_constant_buffer(self, tensor_map, use_inactive, validate_full_updates, user_managed):
        assert validate_full_updates and user_managed and set(tensor_map) == set(self.sources)
        if use_inactive:
            self.inactive = dict(tensor_map)
        else:
            assert not self.active, "the active buffer is filled only while empty"
            self.active = dict(tensor_map)
        self.calls.append("update" if use_inactive else "update active")

    def update_constant_buffer_from_blob(self, path):
        self.active = {name: tensor.clone() for name, tensor in self.own.items()}
        self.calls.append("read own")

    def swap_constant_buffer(self):
        self.active, self.inactive = self.inactive, self.active
        self.calls.append("swap")

    def free_inactive_constant_buffer(self):
        self.inactive = None
        self.calls.append("free")


def runner_of(constants, sources=None, apart=False) -> PackageRunner:
    runner = PackageRunner.__new__(PackageRunner)  # no library: the stand-in holds the constants
    runner.runner, runner.kept = StandInRunner(constants, sources, apart), {}
    runner.blob, runner.has_constants, runner.shared_by = ("blob" if apart else None), not apart, None
    return runner


def aligned(values: list[float], dtype=torch.float32) -> torch.Tensor:
    """A tensor at an address that is a multiple of ALIGNMENT, as AOTInductor places each constant."""
    item = torch.tensor(0, dtype=dtype).element_size()
    storage = torch.empty(len(values) + ALIGNMENT // item, dtype=dtype)
    skip = (-storage.data_ptr() % ALIGNMENT) // item
    tensor = storage[skip : skip + len(values)]
    tensor.copy_(torch.tensor(values, dtype=dtype))
    return tensor


def test_equal_constants_are_shared_and_the_others_copied():
    owner = runner_of({"w": aligned([1, 2, 3, 4]), "b": aligned([5, 6]), "n": aligned([7, 8, 9, 10])})
    own = {
        "w2": aligned([1, 2, 3, 4]),  # the owner's "w", under another name
        "b": aligned([5, 6], torch.float64),  # equal values, another dtype: not the same bytes
        "n": aligned([7, 8, 9, 11]),  # one value differs
        "t": aligned([1, 2, 3, 4]).view(2, 2),  # w's bytes, another shape
    }
    sharer = runner_of(dict(own))
    freed = share_constants(owner, sharer)
    assert freed == own["w2"].nbytes and sharer.runner.calls == ["update", "swap", "free"]
    now = sharer.runner.active
    assert now["w2"].data_ptr() == owner.runner.active["w"].data_ptr()
    for name in ("b", "n", "t"):  # a copy of its own, the values it had
        assert now[name].data_ptr() != own[name].data_ptr() and torch.equal(now[name], own[name])
        assert now[name].dtype == own[name].dtype and now[name].shape == own[name].shape
    kept = {name: tensor.data_ptr() for name, tensor in sharer.kept.items()}
    assert kept == {name: tensor.data_ptr() for name, tensor in now.items()}  # alive as long as the package


def test_a_less_aligned_equal_constant_is_not_shared():
    """An equal constant less aligned than a package's own are sure to be (ALIGNMENT) is not shared: a kernel may
    rely on that alignment."""
    storage = aligned([0.0] + [1, 2, 3, 4])
    owner = runner_of({"w": storage[1:]})  # 4 bytes past a multiple of ALIGNMENT
    sharer = runner_of({"w": aligned([1, 2, 3, 4])})
    assert share_constants(owner, sharer) == 0 and sharer.runner.calls == []


def test_an_equal_constant_as_aligned_as_a_packages_own_are_sure_to_be_is_shared():
    """A package's own buffer is malloc's: its constants may lie 16 bytes past a multiple of 64. One of the
    owner's so placed serves a sharer whose own copy happened to lie at a multiple of 64."""
    owner_w, sharer_w = placed([1, 2, 3, 4], 16), placed([1, 2, 3, 4], 64)
    owner, sharer = runner_of({"w": owner_w}), runner_of({"w": sharer_w})
    assert share_constants(owner, sharer) == owner_w.nbytes
    assert sharer.runner.active["w"].data_ptr() == owner_w.data_ptr()


def placed(values: list[float], alignment: int) -> torch.Tensor:
    """A float32 tensor whose address is a multiple of `alignment` (a power of two up to 64), and of no larger one
    up to 64."""
    storage = torch.empty(len(values) + 16)
    for i in range(16):
        address = storage[i:].data_ptr()
        if min(64, address & -address) == alignment:
            return storage[i : i + len(values)].copy_(torch.tensor(values))
    raise AssertionError(f"no float32 in 64 bytes lies at alignment {alignment}")


def test_constants_that_cannot_be_told_apart_are_left_alone():
    """Two constants of one source (Inductor's naming, unique_constant_sources): the runner hands out one by
    that source, so neither package is touched."""
    w = aligned([1, 2, 3, 4])
    owner = runner_of({"w": w})
    sharer = runner_of({"c1": aligned([1, 2, 3, 4]), "c1_0": aligned([9, 9])}, {"c1": "c1", "c1_0": "c1"})
    assert sharer.constants() is None
    assert share_constants(owner, sharer) == 0 and sharer.runner.calls == []
    assert share_constants(sharer, owner) == 0 and owner.runner.calls == []


def test_a_record_of_what_was_shared_serves_later_loads_without_their_own_constants(tmp_path):
    """The first load reads the sharer's own constants and compares; every one had an equal, so it records which.
    A later load of the same packages reads none of its own: each constant is the owner's, as recorded."""
    owner = runner_of({"w": aligned([1, 2, 3, 4]), "b": aligned([5, 6])})
    own = {"w0": aligned([1, 2, 3, 4]), "b0": aligned([5, 6])}
    record = tmp_path / "shared-constants.json"
    first = runner_of(dict(own), apart=True)
    assert attach_constants(owner, first, record, "owner-1") == (own["w0"].nbytes + own["b0"].nbytes, False)
    assert first.runner.calls == ["read own", "update", "swap", "free"] and first.shared_by == "comparison"
    assert json.loads(record.read_text()) == {"owner": "owner-1", "constants": {"w0": "w", "b0": "b"}}

    later = runner_of(dict(own), apart=True)
    assert attach_constants(owner, later, record, "owner-1") == (own["w0"].nbytes + own["b0"].nbytes, True)
    assert later.runner.calls == ["update active"] and later.shared_by == "record"
    assert {n: t.data_ptr() for n, t in later.runner.active.items()} == {
        "w0": owner.runner.active["w"].data_ptr(), "b0": owner.runner.active["b"].data_ptr()}


def test_a_record_of_another_owner_or_of_other_constants_is_not_used(tmp_path):
    """A record names the owner package it was made with, and every one of the sharer's constants: any other
    owner (built again), or a record that misses a constant, means comparing again."""
    owner = runner_of({"w": aligned([1, 2, 3, 4])})
    record = tmp_path / "shared-constants.json"
    record.write_text(json.dumps({"owner": "owner-0", "constants": {"w0": "w"}}))
    sharer = runner_of({"w0": aligned([1, 2, 3, 4])}, apart=True)
    assert attach_constants(owner, sharer, record, "owner-1")[1] is False and sharer.runner.calls[0] == "read own"
    assert json.loads(record.read_text())["owner"] == "owner-1"  # written again, for this owner

    record.write_text(json.dumps({"owner": "owner-1", "constants": {"w0": "w"}}))
    two = runner_of({"w0": aligned([1, 2, 3, 4]), "x": aligned([7.0])}, apart=True)
    assert attach_constants(owner, two, record, "owner-1")[1] is False and two.runner.calls[0] == "read own"


def test_no_record_is_written_where_a_constant_had_no_equal(tmp_path):
    """A constant of the sharer's own (no equal in the owner) must be read from its file at every load: no record."""
    owner = runner_of({"w": aligned([1, 2, 3, 4])})
    sharer = runner_of({"w0": aligned([1, 2, 3, 4]), "x": aligned([7.0, 8.0])}, apart=True)
    record = tmp_path / "shared-constants.json"
    assert attach_constants(owner, sharer, record, "owner-1") == (aligned([1, 2, 3, 4]).nbytes, False)
    assert not record.exists() and torch.equal(sharer.runner.active["x"], torch.tensor([7.0, 8.0]))
