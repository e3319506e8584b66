"""deploy/Dockerfile: a multi-stage, non-root image whose health check works.

No Docker engine runs in CI, so the image is not built here. These tests pin what the build
relies on (the files it copies exist and pass its ignore file, the entry point is the installed
console script, every ENV is a real setting) and run its HEALTHCHECK command, as the engine
would, against a live proxy.
"""

from __future__ import annotations

import asyncio
import fnmatch
import sys
import tomllib
from typing import Any

from deploy_files import (
    DEPLOY,
    DOCKERFILE,
    ROOT,
    Instruction,
    arg_defaults,
    dockerfile_instructions,
    env_of,
    expand,
    stages,
)
from fakes import LlamaFake, serve

from proxy.app import admin_app, build_app
from proxy.config import ENV_PREFIX, OPTIONS, resolve
from tests.ports import free_port

BASE_IMAGE = "python:3.11-slim"
BUILD_TOOLS = ("gcc", "g++", "build-essential", "make", "cmake", "python3-dev", "git")


def final_stage() -> list[Instruction]:
    return stages(dockerfile_instructions())[-1]


def only(stage: list[Instruction], keyword: str) -> Instruction:
    found = [i for i in stage if i.keyword == keyword]
    assert len(found) == 1, f"expected one {keyword} in the final stage, found {len(found)}"
    return found[0]


def healthcheck_command() -> list[str]:
    ins = only(final_stage(), "HEALTHCHECK")
    options = [w for w in ins.args.split() if w.startswith("--")]
    rest = ins.args.split(None, len(options))[-1]
    assert rest.startswith("CMD "), ins.args
    cmd = Instruction("CMD", rest.removeprefix("CMD ").strip()).exec_form()
    assert cmd is not None, "HEALTHCHECK must use the exec form"
    return cmd


def test_two_stages_on_python_slim() -> None:
    """Stage 1 builds wheels on python:3.11-slim; stage 2 starts again from the same base."""
    instructions = dockerfile_instructions()
    args = arg_defaults(instructions)
    froms = [expand(i.args, args) for i in instructions if i.keyword == "FROM"]
    assert len(froms) == 2
    assert froms[0].split()[0] == BASE_IMAGE and froms[0].lower().endswith(" as build")
    assert froms[1] == BASE_IMAGE
    build = stages(instructions)[0]
    assert any("pip wheel" in i.args for i in build if i.keyword == "RUN")


def test_final_stage_installs_wheels_without_build_tools() -> None:
    """The runtime stage installs from the build stage's wheels, offline, with no compiler."""
    runs = [i.args for i in final_stage() if i.keyword == "RUN"]
    assert any("from=build" in r and "--no-index" in r for r in runs)
    for run in runs:
        assert "apt-get install" not in run and "apk add" not in run
        for tool in BUILD_TOOLS:
            assert f" {tool} " not in f" {run} "
    assert not [i for i in final_stage() if i.keyword in {"COPY", "ADD"}], (
        "the runtime stage gets wheels through a bind mount, not a layer"
    )


def test_runs_as_non_root_user() -> None:
    """USER is set to a numeric non-zero uid before the entry point."""
    user = only(final_stage(), "USER").args
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) > 0, user


def test_entrypoint_is_the_console_script() -> None:
    """ENTRYPOINT runs `prefixgate serve`, the script pyproject.toml installs."""
    assert only(final_stage(), "ENTRYPOINT").exec_form() == ["prefixgate", "serve"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["prefixgate"] == "proxy.cli:main"


def test_env_names_real_settings_and_expose_matches_port() -> None:
    """Every PREFIXGATE_* ENV is a setting the proxy reads; EXPOSE is the port it listens on."""
    env = env_of(final_stage())
    names = {o.env for o in OPTIONS}
    ours = {k: v for k, v in env.items() if k.startswith(ENV_PREFIX)}
    assert ours and set(ours) <= names, set(ours) - names
    settings = resolve({"backend": ["http://llama:8080"]}, environ=ours)
    assert settings.host == "0.0.0.0"
    exposed = only(final_stage(), "EXPOSE").args.split()
    assert exposed == [f"{settings.port}", f"{settings.admin_port}"]  # traffic, then admin


def _ignored(name: str, patterns: list[str]) -> bool:
    """Whether a top-level path is excluded by .dockerignore patterns (last match wins)."""
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        bare = pattern.removeprefix("!").rstrip("/")
        if fnmatch.fnmatch(name, bare):
            excluded = not negate
    return excluded


def test_copied_sources_exist_and_are_in_the_context() -> None:
    """Each COPY source exists in the repository and is not excluded by the ignore file."""
    ignore = DEPLOY / "Dockerfile.dockerignore"
    patterns = [
        line.strip()
        for line in ignore.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copies = [i for i in dockerfile_instructions() if i.keyword == "COPY"]
    assert copies
    for ins in copies:
        words = [w for w in ins.args.split() if not w.startswith("--")]
        for src in words[:-1]:
            assert (ROOT / src).exists(), src
            assert not _ignored(src.rstrip("/"), patterns), f"{src} is excluded from the context"
    assert _ignored("tests", patterns) and _ignored(".venv", patterns)


async def run_healthcheck(port: int) -> int:
    """Run the image's HEALTHCHECK command (with this interpreter as `python`) against the admin
    listener on ``port``."""
    cmd = healthcheck_command()
    assert cmd[0] == "python"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *cmd[1:],
        env={"PREFIXGATE_ADMIN_PORT": str(port)},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    return await asyncio.wait_for(proc.wait(), timeout=20)


async def test_healthcheck_passes_against_a_live_proxy(aiohttp_server: Any) -> None:
    """The HEALTHCHECK command exits 0 against a running proxy's /healthz (its admin port)."""
    fake = await serve(LlamaFake(), aiohttp_server)
    app = build_app(resolve({"backend": [fake.url]}, environ={}))
    await aiohttp_server(app)
    admin = await aiohttp_server(admin_app(app))
    assert await run_healthcheck(admin.port) == 0


async def test_healthcheck_fails_when_nothing_listens() -> None:
    """... and exits non-zero when nothing answers on the port."""
    assert await run_healthcheck(free_port()) != 0


def test_dockerfile_path_is_the_one_compose_builds() -> None:
    """The Dockerfile tests look at the file compose.yaml builds."""
    assert DOCKERFILE == DEPLOY / "Dockerfile" and DOCKERFILE.is_file()
