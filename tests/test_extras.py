"""Install hints name a command that works where protofl was installed from."""

from __future__ import annotations

from pathlib import Path

import pytest

from protofl import extras


def test_a_checkout_gets_an_editable_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 43: messages said pip install 'protofl[hf]', which fails from a checkout."""
    root = extras.checkout_root()
    assert root is not None and (root / "src" / "protofl").is_dir()
    monkeypatch.chdir(root)
    assert extras.install_hint("hf") == "pip install -e '.[hf]'"
    monkeypatch.chdir(Path("/"))
    assert extras.install_hint("text") == f"pip install -e '{root}[text]'"
    monkeypatch.setattr(extras, "checkout_root", lambda: None)
    assert extras.install_hint("flower") == "pip install 'protofl[flower]'"


def test_the_text_backbones_hint_is_the_checkout_one() -> None:
    from protofl.models.transformers_backbones import INSTALL_HINT

    assert INSTALL_HINT.startswith("pip install -e '")
