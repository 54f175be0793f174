"""The documentation site: its generated pages are fresh, it builds with ``mkdocs build --strict`` (every
page in the nav, every link and anchor resolving), every reference the code makes into it resolves, and the
README stays the short front page."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import docs_reference

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CODE_DIRS = ("controller", "loadbalancer", "replica_agent", "trainer_agent", "trainer_client", "mesh_runtime",
             "launcher", "simulator", "weight_transfer", "modeling", "tests", "deploy", "examples", "scripts")


def code_files():
    for top in CODE_DIRS:
        for path in (ROOT / top).rglob("*"):
            suffix_ok = path.suffix in {".py", ".yaml", ".yml", ".service", ""}
            if path.is_file() and suffix_ok and ".build" not in path.parts:
                yield path


def test_the_generated_reference_pages_are_fresh():
    for name, text in docs_reference.pages().items():
        page = DOCS / "reference" / name
        assert page.read_text() == text, f"docs/reference/{name} is stale: run scripts/gen-docs"


def test_the_configuration_reference_has_every_servers_keys_each_with_its_meaning():
    import importlib  # noqa: PLC0415

    from launcher.cli import SERVERS  # noqa: PLC0415
    from launcher.job_config import JobConfig  # noqa: PLC0415

    page = (DOCS / "reference" / "configuration.md").read_text()
    for key in ("`listen`", "`outlier_detection.consecutive_failures`", "`prefix_routing.block_tokens`",
                "`tls.cert`", "`flush_interval_s`", "`replica_processes`", "`store_lease_ttl_s`"):
        assert key in page
    for cls in [*(importlib.import_module(m).CONFIG_CLASS for m in SERVERS.values()), JobConfig]:
        undocumented = [key for key, _, _, meaning in docs_reference.config_rows(cls) if not meaning]
        assert not undocumented, f"{cls.__name__}: keys without help text: {undocumented}"


def test_the_api_reference_has_every_method_with_its_comment():
    page = (DOCS / "reference" / "api.md").read_text()
    for method in ("LoadBalancerService.Generate", "ControllerService.BeginTrainingStep",
                   "ReplicaAgentService.Sleep", "TrainerAgentService.StopTraining"):
        assert f"#### {method} " in page
    assert "Authorization: trainer-agent, client, operator." in page   # Generate's comment, verbatim


def test_the_site_builds_strictly(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "reference" / "api" / "index.html").is_file()


def test_a_broken_link_fails_the_strict_build(tmp_path):
    """The strictness is real: a page linking to an anchor that does not exist stops the build."""
    site = tmp_path / "site"
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\nSee [the controller](controller.md#no-such-section).\n")
    (docs / "controller.md").write_text("# Controller\n\n## Fleet scale\n")
    config = (ROOT / "mkdocs.yml").read_text()
    config = re.sub(r"(?ms)^nav:.*", "nav:\n  - index.md\n  - controller.md\n", config)
    (tmp_path / "mkdocs.yml").write_text(config)
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode != 0
    assert "no-such-section" in result.stdout + result.stderr


def test_every_reference_from_the_code_into_the_docs_resolves():
    weaknesses = set(re.findall(r"(?m)^(\d+)\. \*\*", (DOCS / "known-weaknesses.md").read_text()))
    architecture = (DOCS / "architecture.md").read_text()
    principles = architecture[architecture.index("## Principles"):architecture.index("## Code conventions")]
    principle_numbers = set(re.findall(r"(?m)^(\d+)\. \*\*", principles))
    problems = []
    for path in code_files():
        text = path.read_text(errors="replace")
        where = path.relative_to(ROOT)
        for first, second in re.findall(r"known weakness(?:es)? (\d+)(?: and (\d+))?", text):
            problems += [f"{where}: known weakness {n}" for n in (first, second) if n and n not in weaknesses]
        for page in re.findall(r"(?<![\w/.])docs/((?:reference/)?[\w\-]+\.md)", text):
            if not (DOCS / page).is_file():
                problems.append(f"{where}: docs/{page}")
        for number in re.findall(r"docs/architecture\.md, principle (\d+)", text):
            if number not in principle_numbers:
                problems.append(f"{where}: principle {number}")
        for stale in ("DESIGN.md", "CONVENTIONS.md"):   # documents outside the repository, before docs/
            if stale in text and path.name != "test_docs.py":
                problems.append(f"{where}: mentions {stale}")
    assert not problems, problems
    assert len(weaknesses) == 20 and len(principle_numbers) == 10


def test_every_page_is_in_the_nav_and_the_readme_links_to_pages_that_exist():
    config = (ROOT / "mkdocs.yml").read_text()
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages == set(re.findall(r": ([\w\-/]+\.md)$", config, re.M))
    readme = (ROOT / "README.md").read_text()
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / link).is_file(), link
    assert len(readme.splitlines()) < 120, "the README is the front page: what, quick start, links"
    quick = readme[readme.index("## Quick start"):readme.index("## Documentation")]
    commands = re.findall(r"```bash\n(.*?)```", quick, re.S)[0].strip().splitlines()
    assert [c.split()[0] for c in commands] == ["scripts/quickstart", "scripts/test"]


GRPC_CODES = {"CANCELLED", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
              "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "OUT_OF_RANGE", "UNIMPLEMENTED",
              "DATA_LOSS"}


def test_no_written_page_keeps_a_placeholder():
    """A hand-written page's prose names no SHOUTED_NAME outside code but a gRPC status: anything else is a
    placeholder left for figures or text that never came (or a name that belongs in backticks)."""
    found = []
    pages = [ROOT / "README.md", *(p for p in DOCS.rglob("*.md") if "reference" not in p.relative_to(DOCS).parts)]
    for page in pages:
        prose = re.sub(r"`[^`]*`", "", re.sub(r"```.*?```", "", page.read_text(), flags=re.S))
        for word in re.findall(r"\b(?:[A-Z][A-Z0-9]*_[A-Z0-9_]+|TODO|TBD|FIXME|XXX)\b", prose):
            if word not in GRPC_CODES:
                found.append(f"{page.relative_to(ROOT)}: {word}")
    assert not found, found
