"""The package's folders are seen by tools that honour common global ignore files."""

import subprocess
from pathlib import Path

import pytest

import dflash_train

PACKAGE = Path(dflash_train.__file__).parent
BUILD_OUTPUT_NAMES = {"target", "build", "dist", "out", "bin", "obj", "node_modules", "vendor"}
"""Folder names that Cargo, Maven, setuptools, npm and others write build output to, and that
global gitignores, IDE indexers and code-search tools therefore skip."""


def test_no_package_folder_has_a_build_output_name():
    folders = [p for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__"]
    named = [str(p.relative_to(PACKAGE)) for p in folders if p.name in BUILD_OUTPUT_NAMES]
    assert not named, f"rename these package folders: {named}"


def test_git_ignores_no_source_file_of_the_package():
    repo = PACKAGE.parent
    if not (repo / ".git").exists():
        pytest.skip("not a git checkout")
    sources = [str(p.relative_to(repo)) for p in PACKAGE.rglob("*.py")]
    # --no-index: judge the paths by the ignore rules alone, tracked or not
    out = subprocess.run(["git", "check-ignore", "--no-index", *sources], cwd=repo,
                         capture_output=True, text=True)
    assert out.stdout.strip() == "", f"ignored by git: {out.stdout.split()}"
