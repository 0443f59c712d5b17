"""Files zoe creates cannot be turned against it (issue 49): a second local user, who owns the folder zoe
writes into, races a symbolic link over every file zoe creates there — at once, through inotify — and plants
links in advance at every name zoe could be predicted to use (the next pids' temporaries). The link points at
a file only root may write. Whatever zoe does — write, refuse or fail — that file stays as it was, every time.

Each entry point is tried TRIES times; the test prints, per entry point, the tries, the names the racer
replaced by a link, the links it planted in advance, how many tries zoe refused or failed, and how many the
racer won (the victim changed): "won 0" is the pass. Needs root (to create the second user); skipped with
the reason otherwise."""
from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from conftest import batches, make_mlp, train

ZOE = Path(__file__).resolve().parents[2] / "build" / "zoe"
ATTACKER = "zoe-race"
TRIES = 100
VICTIM_TEXT = b"only root may write this file\n"
# The files a swap store or a parameter tier creates and then writes for the whole run: where a reopen by name
# would redirect the writes. (Racing the owner locks too only makes zoe fail earlier, on any code.)
SWAP_FILES = (".zoe-swap", ".zoe-swap.table", ".zoe-params")


def _attacker_uid() -> tuple[int, int] | None:
    try:
        pw = pwd.getpwnam(ATTACKER)
    except KeyError:
        useradd = shutil.which("useradd") or "/usr/sbin/useradd"
        if not os.path.exists(useradd):
            return None
        subprocess.run([useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", ATTACKER],
                       check=True, capture_output=True)
        pw = pwd.getpwnam(ATTACKER)
    return pw.pw_uid, pw.pw_gid


def _system_python() -> str:
    """A Python the second user may run (the test's own may live in root's home)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    pytest.skip("no system python3 the second user can run (/usr/bin/python3)")


pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the race needs a second local user, and creating one "
                                                          "needs root")

# The attacker: watches the folder with inotify and renames a link to the victim over every new file (a new
# folder is moved aside and a link to the victim's folder put at its name), and keeps links planted at the
# names zoe's old code could be predicted to use for the next pids. Prints its counts when told to stop.
RACER = r"""
import ctypes, hashlib, os, select, signal, struct, sys
folder, victim, victim_dir, names = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
only = tuple(s for s in sys.argv[5].split(",") if s)  # swap only names ending so (none given: every name)
libc = ctypes.CDLL(None, use_errno=True)
IN_CREATE, IN_MOVED_TO, IN_ISDIR = 0x100, 0x80, 0x40000000
ino = libc.inotify_init1(os.O_NONBLOCK)
libc.inotify_add_watch(ino, folder.encode(), IN_CREATE | IN_MOVED_TO)
swapped = planted = 0
seq = 0
def scope():
    boot = open("/proc/sys/kernel/random/boot_id").read().split()[0]
    h = 0xcbf29ce484222325
    for c in (boot + "|" + os.readlink("/proc/self/ns/pid")).encode():
        h = ((h ^ c) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return "%016x" % h
SCOPE = scope()
def link(target, name):
    global seq
    seq += 1
    tmp = os.path.join(folder, ".race-%d" % seq)
    os.symlink(target, tmp)
    try:
        os.rename(tmp, os.path.join(folder, name))
        return True
    except OSError:
        os.unlink(tmp)
        return False
def plant():
    global planted
    last = int(open("/proc/sys/kernel/ns_last_pid").read())
    for pid in range(last + 1, last + 16):
        for name in names:
            for n in (name.replace("{scope}", SCOPE).replace("{pid}", str(pid)),):
                p = os.path.join(folder, n)
                if not os.path.lexists(p):
                    try:
                        os.symlink(victim, p); planted += 1
                    except OSError:
                        pass
def stop(*_):
    print("swapped %d planted %d" % (swapped, planted), flush=True)
    os._exit(0)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
while True:
    if names != [""]:
        plant()
    r, _, _ = select.select([ino], [], [], 0.002)
    if not r:
        continue
    try:
        data = os.read(ino, 65536)
    except BlockingIOError:
        continue
    at = 0
    while at < len(data):
        wd, mask, cookie, length = struct.unpack_from("iIII", data, at)
        name = data[at + 16:at + 16 + length].rstrip(b"\0").decode()
        at += 16 + length
        if name.startswith(".race-") or (only and not name.endswith(only)):
            continue
        path = os.path.join(folder, name)
        try:
            if os.path.islink(path):
                continue
            if mask & IN_ISDIR:
                os.rename(path, path + ".moved"); os.symlink(victim_dir, path); swapped += 1
            elif link(victim, name):
                swapped += 1
        except OSError:
            pass
"""


class Race:
    """One attacker-owned folder, one victim file and one racer process per entry point."""

    def __init__(self, root: Path, uid: int, gid: int, predicted: list[str], only: tuple[str, ...] = ()):
        self.victim_dir = root / "victim"
        self.victim_dir.mkdir(mode=0o700)
        self.victim = self.victim_dir / "secret"
        self.victim.write_bytes(VICTIM_TEXT)
        self.victim.chmod(0o600)
        self.folder = root / "shared"
        self.folder.mkdir()
        os.chown(self.folder, uid, gid)
        self.folder.chmod(0o755)
        self.racer = subprocess.Popen([_system_python(), "-c", RACER, str(self.folder), str(self.victim),
                                       str(self.victim_dir), ",".join(predicted), ",".join(only)],
                                      user=uid, group=gid, stdout=subprocess.PIPE, text=True)
        assert self.racer.stdout.readline().strip() == "ready"
        self.tries = self.won = self.failed = 0

    def intact(self) -> bool:
        st = os.lstat(self.victim)
        return (not self.victim.is_symlink() and st.st_uid == 0 and self.victim.read_bytes() == VICTIM_TEXT and
                sorted(os.listdir(self.victim_dir)) == ["secret"])

    def attempt(self, action) -> None:
        self.tries += 1
        try:
            ok = action()
        except AssertionError:  # a signal, say: never allowed
            raise
        except Exception:  # zoe refusing or failing is allowed; writing the victim is not
            ok = False
        self.failed += not ok
        if not self.intact():
            self.won += 1
            self.victim.write_bytes(VICTIM_TEXT)
            for extra in set(os.listdir(self.victim_dir)) - {"secret"}:
                p = self.victim_dir / extra
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()

    def finish(self, label: str) -> str:
        self.racer.send_signal(signal.SIGTERM)
        out, _ = self.racer.communicate(timeout=30)
        line = (f"{label}: {self.tries} tries, racer {out.strip()}, zoe refused or failed {self.failed}, "
                f"won {self.won}")
        print(line)
        return line


@pytest.fixture(scope="module")
def attacker():
    ids = _attacker_uid()
    if ids is None:
        pytest.skip("no useradd on this machine to create the second user")
    return ids


@pytest.fixture
def race_root():
    root = Path(tempfile.mkdtemp(prefix="zoe-race-", dir="/tmp"))
    root.chmod(0o755)  # the attacker must reach its folder inside
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _cli(*args) -> bool:
    r = subprocess.run([str(ZOE), *map(str, args)], capture_output=True, text=True, timeout=120)
    assert r.returncode in (0, 1, 2), f"zoe {' '.join(map(str, args))} ended by signal {-r.returncode}: {r.stderr}"
    return r.returncode == 0


needs_cli = pytest.mark.skipif(not ZOE.exists(), reason="build/zoe is not built")


@needs_cli
def test_zoe_probe(attacker, race_root):
    race = Race(race_root, *attacker, predicted=[".zoe-probe-{pid}"])
    for _ in range(TRIES):
        race.attempt(lambda: _cli("probe", race.folder, "--bytes", "64K"))
    race.finish("zoe probe")
    assert race.won == 0


@needs_cli
def test_zoe_bench_nvme(attacker, race_root):
    race = Race(race_root, *attacker, predicted=[""], only=SWAP_FILES)
    for _ in range(TRIES):
        race.attempt(lambda: _cli("bench", "nvme", "--path", race.folder, "--n", "64K", "--tile", "384K",
                                  "--reps", "1"))
    race.finish("zoe bench nvme")
    assert race.won == 0


def test_offload_optimizer_nvme(attacker, race_root):
    import zoe.torch

    race = Race(race_root, *attacker, predicted=[""], only=SWAP_FILES)
    model = make_mlp(seed=3, dtype=torch.bfloat16)  # tier nvme sends the device 16-bit weights

    def run():
        opt = zoe.torch.OffloadOptimizer(model.parameters(), lr=1e-3, tier="nvme", nvme_path=str(race.folder))
        train(model, opt, batches(1))
        del opt
        return True

    for _ in range(TRIES):
        race.attempt(run)
    race.finish("OffloadOptimizer(tier=nvme)")
    assert race.won == 0


def test_offload_parameters_nvme(attacker, race_root):
    import zoe.torch

    race = Race(race_root, *attacker, predicted=[""], only=SWAP_FILES)

    def run():
        model = make_mlp(seed=4)
        offload = zoe.torch.offload_parameters(model, device="nvme", nvme_path=str(race.folder))
        try:
            model(torch.randn(2, 32)).sum().backward()
        finally:
            offload.remove()
        return True

    for _ in range(TRIES):
        race.attempt(run)
    race.finish("offload_parameters(device=nvme)")
    assert race.won == 0


def _checkpoint(folder: Path) -> Path:
    import zoe.torch

    model = make_mlp(seed=5)
    opt = zoe.torch.OffloadOptimizer(model.named_parameters(), lr=1e-3)
    train(model, opt, batches(1))
    path = folder / "run.zoe"
    opt.save_checkpoint(str(path))
    return path


@needs_cli
def test_zoe_export(attacker, race_root, tmp_path):
    checkpoint = _checkpoint(tmp_path)
    race = Race(race_root, *attacker, predicted=["model.safetensors.tmp-{scope}-{pid}"])
    for _ in range(TRIES):
        race.attempt(lambda: _cli("export", checkpoint, "--out", race.folder))
    race.finish("zoe export")
    assert race.won == 0


def test_save_checkpoint(attacker, race_root):
    import zoe.torch

    race = Race(race_root, *attacker, predicted=[""])
    model = make_mlp(seed=6)
    opt = zoe.torch.OffloadOptimizer(model.parameters(), lr=1e-3)
    train(model, opt, batches(1))

    def run():
        opt.save_checkpoint(str(race.folder / "ck.zoe"))
        return True

    for _ in range(TRIES):
        race.attempt(run)
    race.finish("save_checkpoint")
    assert race.won == 0


def test_state_dict_with_tmpdir_in_the_folder(attacker, race_root, monkeypatch):
    import zoe.torch

    race = Race(race_root, *attacker, predicted=[""])
    model = make_mlp(seed=7)
    opt = zoe.torch.OffloadOptimizer(model.parameters(), lr=1e-3)
    train(model, opt, batches(1))
    # state_dict() passes the engine's checkpoint through a scratch file under the temporary folder.
    monkeypatch.setattr(tempfile, "tempdir", str(race.folder))

    def run():
        opt.state_dict()
        return True

    for _ in range(TRIES):
        race.attempt(run)
        shutil.rmtree(race.folder / f"zoe-scratch-{os.getuid()}.moved", ignore_errors=True)
    race.finish("state_dict()")
    assert race.won == 0
