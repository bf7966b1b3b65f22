"""shared_constants.py's rule and its record, on stand-in runners: a constant of the sharer is the owner's where
equal (same bytes, dtype, shape and strides, aligned as a package can count on); where every one has an equal the
sharer is given the owner's, its own file read by a runner of its own, never by the sharer, and a record says which,
so a later load reads none of its own; where one has none, or they cannot be told apart, the sharer reads its own
file, and the record says so, so a later load compares no more.
The real packages share in test_compiled_step.py (test_the_whole_forward_is_packaged_once_and_loaded_after)."""

import json

import torch

from minfer.compiled.shared_constants import (
    ALIGNMENT, READS_OWN, PackageRunner, attach_constants, equal_constants, recorded_owner,
)


class StandInRunner:
    """AOTInductor's CPU runner as shared_constants uses it: its constants' names and sources, its file read in,
    the active buffer filled."""

    def __init__(self, file: dict[str, torch.Tensor], sources: dict[str, str] | None):
        self.file, self.active = file, {}
        self.sources = sources or {name: name for name in file}
        self.calls = []

    def get_constant_names_to_original_fqns(self):
        return dict(self.sources)

    def extract_constants_map(self, use_inactive):
        return {self.sources[name]: tensor for name, tensor in self.active.items()}

    def update_constant_buffer_from_blob(self, path):
        self.active = {name: tensor.clone() for name, tensor in self.file.items()}
        self.calls.append("read own")

    def update_constant_buffer(self, tensor_map, use_inactive, validate_full_updates, user_managed):
        assert not use_inactive and validate_full_updates and user_managed and set(tensor_map) == set(self.sources)
        assert not self.active, "given constants while holding some"
        self.active = dict(tensor_map)
        self.calls.append("given")


class StandIn(PackageRunner):
    """A package of stand-in runners: `file` is what its file of constants holds."""

    def __init__(self, file: dict[str, torch.Tensor], sources: dict[str, str] | None = None):
        self.file, self.sources, self.readers = file, sources, []
        self.runner, self.blob, self.kept, self.shared_by = StandInRunner(file, sources), "blob", {}, None

    def reader(self):
        self.readers.append(StandIn(self.file, self.sources))
        return self.readers[-1]


def owner_of(constants: dict[str, torch.Tensor]) -> StandIn:
    owner = StandIn(constants)
    owner.runner.active = dict(constants)  # as it holds them once it read its own
    return owner


def aligned(values: list[float], dtype=torch.float32) -> torch.Tensor:
    """A tensor at an address that is a multiple of ALIGNMENT, as AOTInductor places each constant."""
    item = torch.tensor(0, dtype=dtype).element_size()
    storage = torch.empty(len(values) + ALIGNMENT // item, dtype=dtype)
    skip = (-storage.data_ptr() % ALIGNMENT) // item
    tensor = storage[skip : skip + len(values)]
    tensor.copy_(torch.tensor(values, dtype=dtype))
    return tensor


def placed(values: list[float], alignment: int) -> torch.Tensor:
    """A float32 tensor whose address is a multiple of `alignment` (a power of two up to 64), and of no larger one
    up to 64."""
    storage = torch.empty(len(values) + 16)
    for i in range(16):
        address = storage[i:].data_ptr()
        if min(64, address & -address) == alignment:
            return storage[i : i + len(values)].copy_(torch.tensor(values))
    raise AssertionError(f"no float32 in 64 bytes lies at alignment {alignment}")


def test_only_equal_bytes_of_the_same_layout_are_equal():
    theirs = {"w": aligned([1, 2, 3, 4]), "b": aligned([5, 6]), "n": aligned([7, 8, 9, 10])}
    ours = {
        "w2": aligned([1, 2, 3, 4]),  # the owner's "w", under another name
        "b": aligned([5, 6], torch.float64),  # equal values, another dtype: not the same bytes
        "n": aligned([7, 8, 9, 11]),  # one value differs
        "t": aligned([1, 2, 3, 4]).view(2, 2),  # w's bytes, another shape
    }
    assert equal_constants(theirs, ours) == {"w2": "w"}


def test_a_weight_packed_by_onednn_has_no_equal_and_the_sharer_reads_its_own_as_recorded(tmp_path):
    """Where timing chose ATen's GEMM for a layer of the batch package, its weight is oneDNN's opaque tensor: no bytes
    to compare (torch.equal refuses it), so it has no equal. Sharing the plain ones beside it would cost a read of the
    file and a copy of the packed ones at every start: the sharer reads its own file, once a start, and the record
    says so, so a later start compares nothing. Comparing two such weights of one shape raised, once."""
    weight = aligned([1, 2, 3, 4, 5, 6, 7, 8]).view(2, 4)
    owner = owner_of({"w": aligned([1, 2, 3, 4]), "packed": weight.to_mkldnn()})
    file = {"w0": aligned([1, 2, 3, 4]), "packed0": weight.to_mkldnn()}
    assert equal_constants(owner.runner.active, file) == {"w0": "w"}
    record = tmp_path / "shared-constants.json"
    first = StandIn(file)
    assert attach_constants(owner, first, record, "owner-1") == (0, False)
    assert [r.runner.calls for r in first.readers] == [["read own"]] and first.runner.calls == ["read own"]
    assert first.shared_by is None and first.kept == {}
    packed = first.runner.active["packed0"]
    assert packed.is_mkldnn and packed is not owner.runner.active["packed"] and torch.equal(packed.to_dense(), weight)
    assert first.runner.active["w0"].data_ptr() != owner.runner.active["w"].data_ptr()
    assert json.loads(record.read_text()) == {"owner": "owner-1", "constants": READS_OWN}
    assert recorded_owner(record) is None  # a record that gives the sharer nothing: its own file must stay

    later = StandIn(file)
    assert attach_constants(owner, later, record, "owner-1") == (0, True)
    assert later.readers == [] and later.runner.calls == ["read own"] and later.shared_by is None


def test_a_less_aligned_equal_constant_is_not_equal():
    """An equal constant less aligned than a package's own are sure to be (ALIGNMENT) is not shared: a kernel may
    rely on that alignment. One as aligned as a package's own buffer (malloc's: maybe 16 bytes past a multiple of
    64) serves a sharer whose own copy happened to lie at a multiple of 64."""
    storage = aligned([0.0] + [1, 2, 3, 4])
    assert equal_constants({"w": storage[1:]}, {"w": aligned([1, 2, 3, 4])}) == {}  # 4 bytes past ALIGNMENT
    assert equal_constants({"w": placed([1, 2, 3, 4], 16)}, {"w": placed([1, 2, 3, 4], 64)}) == {"w": "w"}


def test_the_first_load_compares_with_a_reader_and_records_what_later_loads_use(tmp_path):
    """The sharer never reads its own file: a reader does, is let go, and the sharer is given the owner's tensors.
    Every one had an equal, so the record says which; a later load reads no file at all."""
    owner = owner_of({"w": aligned([1, 2, 3, 4]), "b": aligned([5, 6])})
    file = {"w0": aligned([1, 2, 3, 4]), "b0": aligned([5, 6])}
    record = tmp_path / "shared-constants.json"
    first = StandIn(file)
    assert attach_constants(owner, first, record, "owner-1") == (file["w0"].nbytes + file["b0"].nbytes, False)
    assert first.runner.calls == ["given"] and [r.runner.calls for r in first.readers] == [["read own"]]
    assert first.shared_by == "comparison"
    assert json.loads(record.read_text()) == {"owner": "owner-1", "constants": {"w0": "w", "b0": "b"}}
    given = {name: tensor.data_ptr() for name, tensor in first.runner.active.items()}
    assert given == {"w0": owner.runner.active["w"].data_ptr(), "b0": owner.runner.active["b"].data_ptr()}

    later = StandIn(file)
    assert attach_constants(owner, later, record, "owner-1") == (file["w0"].nbytes + file["b0"].nbytes, True)
    assert later.runner.calls == ["given"] and later.readers == [] and later.shared_by == "record"
    assert {name: tensor.data_ptr() for name, tensor in later.runner.active.items()} == given


def test_a_constant_with_no_equal_leaves_the_sharer_its_own_file(tmp_path):
    """One constant without an equal, and every constant of the sharer's is its own, read from its file."""
    owner = owner_of({"w": aligned([1, 2, 3, 4])})
    sharer = StandIn({"w0": aligned([1, 2, 3, 4]), "x": aligned([7.0, 8.0])})
    record = tmp_path / "shared-constants.json"
    assert attach_constants(owner, sharer, record, "owner-1") == (0, False)
    assert sharer.runner.calls == ["read own"] and torch.equal(sharer.runner.active["x"], torch.tensor([7.0, 8.0]))
    assert sharer.runner.active["w0"].data_ptr() != owner.runner.active["w"].data_ptr()
    assert json.loads(record.read_text())["constants"] == READS_OWN


def test_a_record_of_another_owner_or_of_other_constants_is_not_used(tmp_path):
    """A record names the owner build it was made with, and every one of the sharer's constants: any other owner
    (built again), or a record that misses a constant, means comparing again."""
    owner = owner_of({"w": aligned([1, 2, 3, 4])})
    record = tmp_path / "shared-constants.json"
    record.write_text(json.dumps({"owner": "owner-0", "constants": {"w0": "w"}}))
    sharer = StandIn({"w0": aligned([1, 2, 3, 4])})
    assert attach_constants(owner, sharer, record, "owner-1")[1] is False and len(sharer.readers) == 1
    assert json.loads(record.read_text())["owner"] == "owner-1"  # written again, for this owner

    record.write_text(json.dumps({"owner": "owner-1", "constants": {"w0": "w"}}))
    two = StandIn({"w0": aligned([1, 2, 3, 4]), "x": aligned([7.0])})
    assert attach_constants(owner, two, record, "owner-1")[1] is False and len(two.readers) == 1


def test_constants_that_cannot_be_told_apart_are_read_as_they_are(tmp_path):
    """Two constants of one source (Inductor's naming, unique_constant_sources): the runner hands out one by that
    source, so the sharer shares nothing and reads its own file."""
    owner = owner_of({"w": aligned([1, 2, 3, 4])})
    sharer = StandIn({"c1": aligned([1, 2, 3, 4]), "c1_0": aligned([9, 9])}, {"c1": "c1", "c1_0": "c1"})
    record = tmp_path / "shared-constants.json"
    assert attach_constants(owner, sharer, record, "owner-1") == (0, False)
    assert sharer.runner.calls == ["read own"] and sharer.shared_by is None and sharer.kept == {}
    assert json.loads(record.read_text())["constants"] == READS_OWN
