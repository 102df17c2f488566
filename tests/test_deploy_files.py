"""docs/deploy.md's install steps, environment files and systemd units are
correct as written: each environment file read by systemd's rules
(tests/systemd_files.py) gives every zkv option a value it takes, in the
directory layout the doc's install steps make; the units pass
``systemd-analyze verify`` and run what the install step installs; and the
documented topology starts from those very files in network namespaces
(zkv/testing/runner/netns.py), where a broker that crashes while paused comes back
paused thanks to its state file."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import click
import pytest
from doc_blocks import ROOT, Block, file_block, parse
from systemd_files import EnvFileError, parse_env_file, parse_unit, setting, unit_environment

DOC = "docs/deploy.md"
BLOCKS = parse((ROOT / DOC).read_text(encoding="utf-8"), DOC)
ENV_FILES = {"/etc/zkv/broker.env": ["broker"], "/etc/zkv/worker.env": ["worker"]}
ENV_FILES["/etc/zkv/client.env"] = ["status", "submit", "pause", "clear", "resume"]
UNITS = {"broker": "/etc/systemd/system/zkv-broker.service", "worker": "/etc/systemd/system/zkv-worker@.service"}
CLIENT_OWN_ENV = {"ZKV_RESULT_ADDR", "ZKV_RESULT_ADVERTISE"}  # read by zkv.Client itself (zkv/net/reply_address.py)
TCP = re.compile(r"^tcp://([0-9.]+|[A-Za-z0-9.-]+):(\d+|\*)$")


def shell_block(first_line: str) -> Block:
    """The deploy.md shell block whose first line starts with ``first_line``."""
    found = [b for b in BLOCKS if b.is_shell and b.body and b.body[0].strip().startswith(first_line)]
    assert len(found) == 1, f"{DOC}: {len(found)} shell blocks start with {first_line!r}"
    return found[0]


def keygen_block() -> Block:
    found = [b for b in BLOCKS if b.is_shell and any("zkv keygen" in line for line in b.body)]
    assert len(found) == 1
    return found[0]


INSTALL = {"broker": "# on the broker host", "gpu": "# on each GPU host", "client": "# on each client host"}


@dataclass
class Host:
    """One host's files as the doc lays them out, under ``root`` instead of ``/``."""

    root: Path
    subs: dict[str, str] = field(default_factory=dict)  # e.g. host a's key name -> host b's

    def sub(self, text: str) -> str:
        for old, new in self.subs.items():
            text = text.replace(old, new)
        return text.replace("/etc/zkv", f"{self.root}/etc/zkv").replace("/var/lib/zkv", f"{self.root}/var/lib/zkv")

    def env_file(self, path: str) -> dict[str, str]:
        """Write the doc's ``path`` under the root and read it back as systemd does."""
        dest = Path(self.sub(path))
        dest.write_text(self.sub(file_block(path).text))
        return parse_env_file(dest.read_text())


def shell(text: str, cwd: Path, timeout: float = 60) -> str:
    env = dict(os.environ, PATH=f"{ROOT / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}", PYTHON=sys.executable)
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", text], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    assert done.returncode == 0, f"`{text}` exited {done.returncode}: {done.stdout}{done.stderr}"
    return done.stdout


def install(block: Block, host: Host, keys_from: Path) -> None:
    """Run an install block into ``host.root``, from a copy of the trusted
    machine's key directories; without a ``zkv`` user here, files stay root's."""
    work = host.root / "work"
    shutil.copytree(keys_from, work)
    for command in block.commands():
        text = re.sub(r" -[og] zkv\b", "", host.sub(command.text))
        shell(text, work)


def deploy(base: Path, world_subs: dict[str, str] | None = None) -> dict[str, Host]:
    """The trusted machine's keys (§1) and every host's install step (§3)."""
    trusted = base / "trusted"
    trusted.mkdir()
    for command in keygen_block().commands():
        shell(command.text, trusted)
    hosts = {
        "broker": Host(base / "broker"),
        "gpu-a": Host(base / "gpu-a"),
        "gpu-b": Host(base / "gpu-b", {"rank-host-a": "rank-host-b"}),
        "client": Host(base / "client"),
    }
    kinds = {"broker": "broker", "gpu-a": "gpu", "gpu-b": "gpu", "client": "client"}
    for name, host in hosts.items():
        host.subs.update(world_subs or {})
        install(shell_block(INSTALL[kinds[name]]), host, trusted)
    return hosts


def option(commands: list[str], envvar: str) -> tuple[click.Command, click.Parameter] | None:
    from zkv.cli.commands import main

    for name in commands:
        cmd = main.commands[name]
        for param in cmd.params:
            if param.envvar == envvar:
                return cmd, param
    return None


# --- systemd's rules --------------------------------------------------------------------


def test_env_files_are_read_by_systemd_rules_not_shell_rules():
    text = (
        "# a comment\n; another\n   # indented\nA=1\n"
        "B=/etc/zkv/ranks        # rank public keys\n"
        'C = spaced value \t\nD=\'single # kept\'  \nE="dq \\"x\\" \\$HOME \\n"\n'
        "F=one\\\ntwo\nG=a'b'\nnot an assignment\nH=\n"
    )
    env = parse_env_file(text)
    assert env == {
        "A": "1",
        "B": "/etc/zkv/ranks        # rank public keys",  # the inline comment is part of the value
        "C": "spaced value",
        "D": "single # kept",
        "E": 'dq "x" $HOME \\n',
        "F": "onetwo",
        "G": "a'b'",
        "H": "",
    }
    with pytest.raises(EnvFileError):
        parse_env_file("1BAD=x\n")
    with pytest.raises(EnvFileError):
        parse_env_file("A='open\n")


def test_no_value_carries_an_inline_comment():
    for path in ENV_FILES:
        for key, value in parse_env_file(file_block(path).text).items():
            assert not re.search(r"\s[#;]", value), f"{path}: systemd sets {key} to {value!r} (inline comment)"


# --- the values and the layout ------------------------------------------------------------


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    return deploy(tmp_path_factory.mktemp("deploy"))


def test_every_env_value_is_what_its_zkv_option_takes(hosts):
    where = {"/etc/zkv/broker.env": "broker", "/etc/zkv/worker.env": "gpu-a", "/etc/zkv/client.env": "client"}
    for path, commands in ENV_FILES.items():
        host = hosts[where[path]]
        for key, value in host.env_file(path).items():
            found = option(commands, key)
            if found is None:
                assert path == "/etc/zkv/client.env" and key in CLIENT_OWN_ENV, f"{path}: no zkv option reads {key}"
                assert TCP.match(value), f"{path}: {key}={value!r} is not tcp://HOST:PORT"
                continue
            cmd, param = found
            ctx = click.Context(cmd, info_name=cmd.name)
            try:
                raw = param.type.split_envvar_value(value) if getattr(param, "multiple", False) else value
                param.type_cast_value(ctx, raw)  # paths must exist: the install step made them
            except click.BadParameter as err:
                pytest.fail(f"{path}: {key}={value!r}: {err.format_message()}")
            if key in {"ZKV_FRONTEND", "ZKV_BACKEND", "ZKV_CONTROL", "ZKV_BROKER"}:
                assert TCP.match(value) and 0 < int(TCP.match(value).group(2)) < 65536, f"{path}: {key}={value!r}"
            if key == "ZKV_CURVE_SECRET":
                assert Path(value).stat().st_mode & 0o777 == 0o600, f"{path}: {value} is not mode 0600"
            if key == "ZKV_STATE_FILE":
                assert Path(value).parent == host.root / "var/lib/zkv", "the state file is not in StateDirectory="


def test_the_hosts_files_agree_with_each_other_and_the_port_table():
    broker, worker, client = (parse_env_file(file_block(p).text) for p in ENV_FILES)
    assert worker["ZKV_BACKEND"] == broker["ZKV_BACKEND"] and worker["ZKV_CONTROL"] == broker["ZKV_CONTROL"]
    assert client["ZKV_BROKER"] == broker["ZKV_FRONTEND"]
    assert worker["ZKV_WORLD_SIZE"] == broker["ZKV_WORLD_SIZE"]
    ports = {k: broker[k].rsplit(":", 1)[1] for k in ("ZKV_FRONTEND", "ZKV_BACKEND", "ZKV_CONTROL")}
    table = (ROOT / DOC).read_text()
    for key, flag in (("ZKV_FRONTEND", "--frontend"), ("ZKV_BACKEND", "--backend"), ("ZKV_CONTROL", "--control")):
        assert f"| {ports[key]}/tcp (`{flag}`) |" in table, f"§2 does not list {ports[key]}/tcp for {flag}"
    assert worker["ZKV_CURVE_SECRET"].endswith("rank-host-a.key_secret")  # keys of §1's keygen
    assert client["ZKV_CURVE_SECRET"].endswith("client-ctl.key_secret")


# --- the units --------------------------------------------------------------------------


def test_units_run_what_the_install_step_installs():
    setup = {shlex.split(c.text)[0]: shlex.split(c.text) for c in shell_block("useradd ").commands()}
    user, venv = setup["useradd"][-1], setup["python3"][-1]
    assert setup["python3"][:3] == ["python3", "-m", "venv"]
    for kind, path in UNITS.items():
        unit = parse_unit(file_block(path).text)
        (exec_start,) = setting(unit, "Service", "ExecStart")
        assert shlex.split(exec_start)[:2] == [f"{venv}/bin/zkv", kind], exec_start
        assert setting(unit, "Service", "User") == [user] and setting(unit, "Service", "Group") == [user]
        (env_file,) = setting(unit, "Service", "EnvironmentFile")
        assert env_file in ENV_FILES, env_file
        assert setting(unit, "Service", "RestartPreventExitStatus") == ["2"]  # a usage error does not loop
    broker = parse_unit(file_block(UNITS["broker"]).text)
    state = parse_env_file(file_block("/etc/zkv/broker.env").text)["ZKV_STATE_FILE"]
    assert Path(state).parent == Path("/var/lib") / setting(broker, "Service", "StateDirectory")[0]
    worker = parse_unit(file_block(UNITS["worker"]).text)
    assert unit_environment(worker, "3") == {"ZKV_RANK": "3"}


def test_the_useradd_line_uses_options_useradd_has():
    if shutil.which("useradd") is None:
        pytest.skip("useradd is not installed here")
    line = shell_block("useradd ").body[0]
    helptext = subprocess.run(["useradd", "--help"], capture_output=True, text=True, timeout=10).stdout
    for word in shlex.split(line):
        if word.startswith("--"):
            assert word in helptext, f"useradd has no {word}"


def test_units_pass_systemd_analyze_verify(tmp_path):
    tool = shutil.which("systemd-analyze")
    system = Path("/usr/lib/systemd/system")
    if tool is None or not (system / "multi-user.target").exists():
        pytest.skip("systemd-analyze or systemd's own units are not installed here")
    root = tmp_path / "root"
    shutil.copytree(system, root / "usr/lib/systemd/system", symlinks=True)  # targets the units name
    (root / "etc/systemd/system").mkdir(parents=True)
    for path in UNITS.values():
        (root / path.lstrip("/")).write_text(file_block(path).text)
    exe = root / "opt/zkv/bin/zkv"  # what the install step's venv provides
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    done = subprocess.run([tool, "verify", f"--root={root}", "--man=no", "zkv-broker.service", "zkv-worker@0.service"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), done.stdout + done.stderr


# --- the documented topology, in network namespaces -----------------------------------------

# Two ranks of a few MiB, not eight of 10 GiB each.
SMALL = {"ZKV_WORLD_SIZE=8": "ZKV_WORLD_SIZE=2", "ZKV_LAYERS=32": "ZKV_LAYERS=2"}
SMALL.update({"ZKV_GPU_BLOCKS=4096": "ZKV_GPU_BLOCKS=32", "ZKV_CPU_BLOCKS=16384": "ZKV_CPU_BLOCKS=64"})


def start_unit(lab, role: str, host: Host, kind: str, instance: str = ""):
    """Start a unit as systemd would: its Environment=, then its EnvironmentFile=
    (which wins), its StateDirectory= made, its ExecStart=, with the checkout's
    zkv for the installed one (and as root: this machine has no zkv user)."""
    unit = parse_unit(file_block(UNITS[kind]).text)
    env = unit_environment(unit, instance)
    for path in setting(unit, "Service", "EnvironmentFile"):
        env.update(parse_env_file(Path(host.sub(path)).read_text()))
    for name in setting(unit, "Service", "StateDirectory"):
        (host.root / "var/lib" / name).mkdir(parents=True, exist_ok=True)
    argv = shlex.split(setting(unit, "Service", "ExecStart")[0])
    assert argv[0] == "/opt/zkv/bin/zkv"
    name = f"{kind}{instance}"
    return lab.spawn(role, name, [sys.executable, "-m", "zkv", *argv[1:]], env={**env, "PYTHONPATH": str(ROOT)})


def client_shell(lab, host: Host, text: str, timeout: float = 60) -> str:
    """Commands on the client host, after the doc's own `set -a; . client.env; set +a`."""
    check = shell_block("# on the client host")
    prefix = "; ".join(host.sub(c.text) for c in check.commands() if not c.command.startswith("/opt/zkv"))
    env = dict(os.environ, PATH=f"{ROOT / 'bin'}{os.pathsep}{os.environ['PATH']}", PYTHON=sys.executable)
    env = {k: v for k, v in env.items() if not k.startswith("ZKV_")}
    done = subprocess.run(["ip", "netns", "exec", lab.hosts["client"].ns, "bash", "-c", f"{prefix}; {text}"], env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert done.returncode == 0, f"`{text}` on the client host exited {done.returncode}: {done.stdout}{done.stderr}"
    return done.stdout


def test_the_documented_topology_runs_from_the_documented_files(tmp_path):
    from zkv.testing.runner import netns

    reason = netns.unavailable()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run this test, but network namespaces are unavailable: {reason}")
        pytest.skip(f"network namespaces unavailable: {reason}")
    with netns.Lab(["broker", "gpu-a", "gpu-b", "client"]) as lab:
        ips = {"10.0.0.10": lab.hosts["broker"].ip, "10.0.0.20": lab.hosts["client"].ip}
        hosts = deploy(tmp_path, {**SMALL, **ips, "--wait-ranks 8": "--wait-ranks 2"})
        for name, path in (("broker", "broker"), ("gpu-a", "worker"), ("gpu-b", "worker"), ("client", "client")):
            hosts[name].env_file(f"/etc/zkv/{path}.env")
        try:
            start_unit(lab, "gpu-a", hosts["gpu-a"], "worker", "0")
            start_unit(lab, "gpu-b", hosts["gpu-b"], "worker", "1")
            broker = start_unit(lab, "broker", hosts["broker"], "broker")
            client = hosts["client"]
            check = shell_block("# on the client host").commands()[-1]
            out = client_shell(lab, client, client.sub(check.text).replace("/opt/zkv/bin/zkv", "zkv"))
            assert "bus RUNNING" in out and out.count(" yes ") == 2, out
            assert ": ok" in client_shell(lab, client, "zkv submit swap-out --src 0-3 --dst 10-13")  # results to :6000
            assert "paused" in client_shell(lab, client, "zkv pause")
            broker.popen.kill()  # a crash in the middle of a weight update; systemd restarts the unit
            broker.popen.wait(10)
            lab.procs.remove(broker)
            state = hosts["broker"].root / "var/lib/zkv/broker-state.json"
            assert state.exists()
            start_unit(lab, "broker", hosts["broker"], "broker")
            out = client_shell(lab, client, "zkv status --wait-ranks 2")
            assert "bus PAUSED" in out, out
            assert "running" in client_shell(lab, client, "zkv resume")
            assert ": ok" in client_shell(lab, client, "zkv submit swap-in --src 10-13 --dst 20-23")
        except BaseException:
            print(lab.logs())
            raise
