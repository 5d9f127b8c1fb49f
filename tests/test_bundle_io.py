"""Fast bundle I/O: aligned blobs, copy-on-write views of the file, verification on and off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kdump.bundle import capture_call, load_bundle, save_calls
from kdump.bundle.tensors import ALIGN_MOD, Placement
from kdump.errors import BundleError

GEN = torch.Generator().manual_seed(99)


def _mapped_file(ptr: int) -> str | None:
    """The file mapped at address `ptr` in this process ("" for anonymous memory)."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= ptr < hi:
                return parts[5].strip() if len(parts) > 5 else ""
    return None


def _bundle(tmp_path: Path) -> tuple[Path, list[torch.Tensor]]:
    big = torch.randn(256, 512, generator=GEN)  # 512 KiB: laid out at its recorded alignment
    other = torch.randint(-(2**31), 2**31 - 1, (64, 1024), dtype=torch.int32, generator=GEN)
    args = [big, big[:, :256], other[1:], torch.randn(7, generator=GEN)]
    return save_calls(tmp_path / "b.kdump", [capture_call("m:f", args)]), args


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_default_cpu_load_is_a_private_view_of_the_file(tmp_path: Path) -> None:
    path, args = _bundle(tmp_path)
    bundle = load_bundle(path)
    first = bundle.calls[0].materialize("cpu")
    big = first.tensors[0]
    assert _mapped_file(big.data_ptr()) == str(path.resolve())  # zero-copy
    assert big.data_ptr() % ALIGN_MOD == args[0].data_ptr() % ALIGN_MOD
    assert first.tensors[1].untyped_storage().data_ptr() == big.untyped_storage().data_ptr()
    # A view deeper into its storage (a prefix to re-create) is a copy, still exact.
    assert first.tensors[2].storage_offset() == args[2].storage_offset()
    assert _mapped_file(first.tensors[2].data_ptr()) != str(path.resolve())
    for got, want in zip(first.tensors, args):
        assert torch.equal(got, want) and got.stride() == want.stride()
    # Writes stay private: not in the file, not in a second load of the same blob.
    before = path.read_bytes()
    big.fill_(3.0)
    second = bundle.calls[0].materialize("cpu")
    assert torch.equal(second.tensors[0], args[0])
    assert path.read_bytes() == before
    assert torch.equal(load_bundle(path).calls[0].args[0], args[0])


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_halo_and_flush_placements_copy(tmp_path: Path) -> None:
    path, args = _bundle(tmp_path)
    call = load_bundle(path).calls[0]
    for placement in (Placement(halo=64), Placement(flush_end=True)):
        mc = call.materialize("cpu", placement)
        assert _mapped_file(mc.tensors[0].data_ptr()) != str(path.resolve())
        assert torch.equal(mc.tensors[0], args[0])


def _corrupt_big_blob(path: Path) -> None:
    bundle = load_bundle(path)
    sha = bundle.calls[0].storages[0].blob
    begin, _ = bundle.inline[sha]
    raw = bytearray(path.read_bytes())
    raw[bundle.data_start + begin + 1000] ^= 0x10
    path.write_bytes(bytes(raw))


def test_zero_copy_view_is_verified_and_no_verify_skips_it(tmp_path: Path) -> None:
    path, args = _bundle(tmp_path)
    _corrupt_big_blob(path)
    with pytest.raises(BundleError, match="checksum mismatch"):
        load_bundle(path).calls[0].materialize("cpu")
    unchecked = load_bundle(path, verify=False)
    got = unchecked.calls[0].materialize("cpu").tensors[0]
    assert not torch.equal(got, args[0])  # the corrupt byte is handed out unchecked
    assert torch.equal(got.flatten()[251:], args[0].flatten()[251:])
    with pytest.raises(BundleError, match="checksum mismatch"):
        unchecked.verify()  # an explicit verify still checks


def test_verified_blobs_pass_on_to_another_process_bundle(tmp_path: Path) -> None:
    path, args = _bundle(tmp_path)
    parent = load_bundle(path)
    parent.calls[0].materialize("cpu")
    done = parent.verified
    assert done == {s.blob for s in parent.calls[0].storages}
    child = load_bundle(path)
    _corrupt_big_blob(path)  # a child that trusts the parent does not hash again
    child.trust(done)
    got = child.calls[0].materialize("cpu").tensors[0]
    assert not torch.equal(got, args[0])
    with pytest.raises(BundleError, match="checksum mismatch"):
        load_bundle(path).calls[0].materialize("cpu")


def test_blobs_sit_at_their_recorded_alignment_in_the_file(tmp_path: Path) -> None:
    path, _ = _bundle(tmp_path)
    bundle = load_bundle(path)
    assert bundle.data_start % ALIGN_MOD == 0
    for st in bundle.calls[0].storages:
        begin, end = bundle.inline[st.blob]
        assert end - begin == st.span_nbytes
        if st.span_nbytes >= 64 << 10:
            assert (bundle.data_start + begin) % ALIGN_MOD == st.alignment


def test_kdump_info_end_to_end_imports_no_torch(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    path, _ = _bundle(tmp_path)
    code = (
        "import sys\n"
        "from kdump.cli import main\n"
        "try:\n"
        f"    main(['info', '--verify', '--json', {str(path)!r}])\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep[0]["verified"] is True if isinstance(rep, list) else rep["verified"] is True


def test_unchanged_output_shares_its_input_snapshot(tmp_path: Path) -> None:
    from kdump.bundle import attach_outputs, input_tensors

    x, y = torch.randn(300, 200, generator=GEN), torch.randn(300, 200, generator=GEN)
    call = capture_call("m:f", [x, y])
    y.mul_(2)  # y changed, x did not
    attach_outputs(call, input_tensors(call, [x, y], {}), [0, 1])
    assert call.outputs.data[0] is call.inputs.data[0]  # compared, not copied
    assert call.outputs.data[1] is not call.inputs.data[1]
    path = save_calls(tmp_path / "o.kdump", [call])
    loaded = load_bundle(path).calls[0]
    outs = loaded.materialize_outputs("cpu")
    assert torch.equal(outs[0], x) and torch.equal(outs[1], y)
    assert torch.equal(loaded.args[1], y / 2)
