"""router.ssh(): contexts on another host over the real OpenSSH client.

The sshd fixture starts Debian's /usr/sbin/sshd on 127.0.0.1 at a free port,
with a host key and a user key made here by ssh-keygen, a known_hosts file
that names that host key (so StrictHostKeyChecking=yes holds: nothing is
disabled), and ``-F /dev/null`` so the user's own ssh config plays no part.
It runs for the module and is stopped at its end. If sshd cannot start (not
installed, no privilege-separation directory, a sandbox without sockets),
the tests skip with sshd's own words, unless SPINDLE_REQUIRE_SSHD=1, which
CI sets so that they can never be skipped there.

The remote side is <build>/spindle-agent (SPINDLE_TOOLS_DIR), uploaded into
a remote_dir of the test's own, so ~/.cache/spindle is left alone.
"""

import getpass
import os
import shutil
import signal
import socket
import subprocess
import time

import pytest

import spindle

SSHD = "/usr/sbin/sshd"
START_TIMEOUT = 10.0  # seconds for sshd to listen


def _must_have_sshd(reason):
    if os.environ.get("SPINDLE_REQUIRE_SSHD") == "1":
        pytest.fail(f"sshd is required (SPINDLE_REQUIRE_SSHD=1) but {reason}")
    pytest.skip(f"no sshd for the ssh tests: {reason}")


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _keygen(path):
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "spindle-test", "-f", str(path)],
                   check=True, stdin=subprocess.DEVNULL, capture_output=True, timeout=30)


class Sshd:
    """A throwaway sshd; options() gives router.ssh() keywords that reach it."""

    def __init__(self, root):
        self.root = root
        self.user = getpass.getuser()
        self.host_key = root / "host_key"
        self.user_key = root / "id_ed25519"
        self.known_hosts = root / "known_hosts"
        self.log_path = root / "sshd.log"
        self.proc = None
        self.port = 0

    def start(self):
        if not os.access(SSHD, os.X_OK):
            _must_have_sshd(f"{SSHD} is not installed (Debian: openssh-server)")
        if shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
            _must_have_sshd("ssh or ssh-keygen is not on PATH (Debian: openssh-client)")
        if os.geteuid() == 0:
            # sshd refuses to start as root without its privilege-separation directory.
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        _keygen(self.host_key)
        _keygen(self.user_key)
        shutil.copyfile(f"{self.user_key}.pub", self.root / "authorized_keys")
        reason = "did not start"
        for _ in range(3):  # the free port may be taken between our probe and sshd's bind
            self.port = _free_port()
            cfg = self.root / "sshd_config"
            cfg.write_text("\n".join([
                f"Port {self.port}",
                "ListenAddress 127.0.0.1",
                f"HostKey {self.host_key}",
                f"AuthorizedKeysFile {self.root / 'authorized_keys'}",
                f"PidFile {self.root / 'sshd.pid'}",
                "StrictModes no",
                "UsePAM no",
                "PermitRootLogin prohibit-password",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "LogLevel ERROR",
                # Keeps the account's ~/.bashrc out of the sessions (bash
                # reads it for ssh commands only at SHLVL < 2), as the C++
                # fixture does.
                "SetEnv SHLVL=1",
                "",
            ]))
            with open(self.log_path, "ab") as log:
                # A process group of its own: stop() reaches the per-connection
                # sshd processes too, never this one.
                self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(cfg)], stdin=subprocess.DEVNULL,
                                             stdout=log, stderr=log, process_group=0)
            reason = self._wait_listening()
            if reason is None:
                host_pub = (self.host_key.parent / "host_key.pub").read_text().split()
                self.known_hosts.write_text(f"[127.0.0.1]:{self.port} {host_pub[0]} {host_pub[1]}\n")
                return
            self.stop()
        _must_have_sshd(reason)

    def _wait_listening(self):
        """None once sshd accepts connections, else why not."""
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return f"sshd exited with {self.proc.returncode}: {self.log().strip()[-500:]}"
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return None
            except OSError:
                time.sleep(0.05)
        return f"sshd did not listen within {START_TIMEOUT} s: {self.log().strip()[-500:]}"

    def log(self):
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self):
        if self.proc is None:
            return
        if self.proc.poll() is None:  # not reaped yet: its pid is still its group's id
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        try:
            # Whatever is left of the group: sessions still open. The group
            # id cannot be reused until every member is gone.
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc = None

    def options(self, **overrides):
        opts = dict(user=self.user, port=self.port, identity_file=str(self.user_key),
                    ssh_args=["-F", "/dev/null", "-o", f"UserKnownHostsFile={self.known_hosts}",
                              "-o", "StrictHostKeyChecking=yes"],
                    connect_timeout=20.0, agent=_agent(), remote_dir=str(self.root / "remote-cache"))
        opts.update(overrides)
        return opts


def _agent():
    path = os.path.join(os.environ.get("SPINDLE_TOOLS_DIR", ""), "spindle-agent")
    if not os.access(path, os.X_OK):
        pytest.fail(f"{path} is not built (make spindle-agent; SPINDLE_TOOLS_DIR names the build directory)")
    return path


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    server = Sshd(tmp_path_factory.mktemp("sshd"))
    server.start()
    yield server
    server.stop()


def test_echo_and_info(router, sshd):
    child = router.ssh("127.0.0.1", **sshd.options(name="ssh-echo"))
    assert child.name == "ssh-echo"
    assert child.call("spindle.echo", "hello over ssh") == "hello over ssh"
    text = "x" * 100_000  # more than one ssh channel packet
    assert child.call("spindle.echo", text) == text
    # The agent answers with the argument's own bytes: bytes stay bytes.
    assert child.call("spindle.echo", b"\x00\xff raw") == b"\x00\xff raw"
    host, pid, machine, peak_rss = child.call("spindle.info")
    assert host == socket.gethostname()
    assert machine == os.uname().machine
    assert pid > 0 and pid != os.getpid()
    assert peak_rss > 0
    # The agent serves by name only: a Python function cannot run there.
    with pytest.raises(spindle.Error):
        child.call("no.such.function")
    assert child.call_async("spindle.echo", "async").result(timeout=30) == "async"
    child.stop()


def test_upload_then_reuse(router, sshd, tmp_path):
    remote_dir = tmp_path / "fresh-cache"  # nothing cached: the first start uploads
    first = router.ssh("127.0.0.1", **sshd.options(remote_dir=str(remote_dir)))
    assert first.call("spindle.echo", "first") == "first"
    cached = sorted(p for p in os.listdir(remote_dir) if p.startswith("spindle-agent-"))
    assert len(cached) == 1, os.listdir(remote_dir)
    agent_file = remote_dir / cached[0]
    assert os.access(agent_file, os.X_OK)
    mtime = agent_file.stat().st_mtime_ns
    first.stop()
    again = router.ssh("127.0.0.1", **sshd.options(remote_dir=str(remote_dir)))
    assert again.call("spindle.echo", "again") == "again"
    assert agent_file.stat().st_mtime_ns == mtime, "the cached agent was written again"
    assert sorted(p for p in os.listdir(remote_dir) if p.startswith("spindle-agent-")) == cached
    again.stop()


def test_auth_failure_is_a_clear_error(router, sshd, tmp_path):
    stranger = tmp_path / "id_stranger"  # a key sshd does not know
    _keygen(stranger)
    t0 = time.monotonic()
    with pytest.raises(spindle.Error) as err:
        router.ssh("127.0.0.1", **sshd.options(identity_file=str(stranger)))
    # BatchMode=yes: refused at once, in ssh's own words, never a prompt.
    assert time.monotonic() - t0 < 15
    assert "Permission denied" in str(err.value), str(err.value)


def test_options_are_checked(router, sshd):
    with pytest.raises(TypeError):
        router.ssh("127.0.0.1", **sshd.options(ssh_args="-v"))
    with pytest.raises(ValueError):
        router.ssh("127.0.0.1", **sshd.options(port=70000))
    with pytest.raises(ValueError):
        router.ssh("127.0.0.1", **sshd.options(connect_timeout=0))


def test_two_hops(router, sshd):
    first = router.ssh("127.0.0.1", **sshd.options(name="hop-1"))
    second = router.ssh("127.0.0.1", **sshd.options(name="hop-2", via=first))
    assert second.call("spindle.echo", "through a hop") == "through a hop"
    _, pid1, _, _ = first.call("spindle.info")
    _, pid2, _, _ = second.call("spindle.info")
    assert pid1 != pid2
    second.stop()
    first.stop()
