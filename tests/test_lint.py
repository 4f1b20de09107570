"""ruff over the package, the launcher and the tests, with the configuration in pyproject.toml; and the spelling of
the README and the pages under docs/."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from conftest import ROOT


def test_ruff_finds_nothing():
    beside = Path(sys.executable).parent / "ruff"
    ruff = [str(beside)] if beside.exists() else [sys.executable, "-m", "ruff"]
    done = subprocess.run([*ruff, "check", "--no-cache", "switchboard", "switchboard.py", "tests"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


# The pages a reader reads: the README and every page under docs/. Our own names (programs, libraries, protocols,
# the words the product coins) are in docs/spelling-words.txt, one a line; a word that is neither English nor
# there is a misspelling, or a name to add to the list.
SPELLING_WORDS = ROOT / "docs" / "spelling-words.txt"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_codespell_finds_no_known_misspelling():
    """codespell's list of common misspellings, over the pages, code spans included. Two words it flags are
    meant: api.md quotes the error for a misspelt field (`titel`), and board.md counts keep-alives."""
    beside = Path(sys.executable).parent / "codespell"
    codespell = [str(beside)] if beside.exists() else [sys.executable, "-m", "codespell_lib"]
    done = subprocess.run([*codespell, "--ignore-words", str(SPELLING_WORDS), "--ignore-words-list", "titel,keep-alives",
                           *(str(p.relative_to(ROOT)) for p in pages())], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


FENCE = re.compile(r"^([ \t]*)```.*?^\1```[ \t]*$", re.S | re.M)


def prose(text: str) -> str:
    """What a page says in words: without its code (fenced blocks, inline spans, also across lines), HTML comments
    (the benchmarks' markers), link targets and bare URLs."""
    text = FENCE.sub("", text)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"``.*?``|`[^`]*`", "", text, flags=re.S)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    return re.sub(r"https?://\S+", "", text)


def unknown_words(text: str, known: set[str]) -> dict[str, int]:
    """Words of three letters or more (a word in digits and letters, such as a commit, is no word) that neither
    the English dictionary nor our list knows, each with the line it first appears on."""
    from spellchecker import SpellChecker
    english = SpellChecker()
    found: dict[str, int] = {}
    for number, line in enumerate(prose(text).splitlines(), 1):
        for word in re.findall(r"\b[A-Za-z]+(?:'[A-Za-z]+)*\b", line):
            word = re.sub(r"'s$", "", word)
            if len(word) >= 3 and word.lower() not in known and word.lower() not in english:
                found.setdefault(word, number)
    return found


def test_every_word_of_the_pages_is_english_or_one_of_our_names():
    """A merge once interleaved two sentences of the README ("whoat evach querue finished in the last holdsur"):
    codespell knows no such words, so every word must be in a dictionary. Lines are counted in the page's prose
    (its code blocks taken out); grep for the word."""
    known = {line.strip().lower() for line in SPELLING_WORDS.read_text().splitlines()
             if line.strip() and not line.startswith("#")}
    unknown = {str(p.relative_to(ROOT)): words for p in pages() if (words := unknown_words(p.read_text(), known))}
    assert not unknown, f"words no dictionary knows (a typo, or a name for docs/spelling-words.txt): {unknown}"


def test_the_spelling_check_catches_an_interleaved_sentence():
    garbled = "and whoat evach querue finished in the last holdsur and live ledase: a `whoat` in code is code"
    assert set(unknown_words(garbled, set())) == {"whoat", "evach", "querue", "holdsur", "ledase"}
