"""The scoreboard site in a real headless chromium (driven through the DevTools protocol, offline):
the matrix renders, the filters work (the controls and the query string), a failure's cell links to
its case under its diagnosis with its plot, a tampered report is marked, and nothing is logged or thrown."""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("cryptography")

import _scoreboard_reports as R  # noqa: E402
from _cdp import Browser  # noqa: E402
from lora_conformance.scoreboard import build  # noqa: E402

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
TAMPERED_RED = "rgb(198, 40, 40)"  # scoreboard.css: .integrity-tampered .integrity


def _executable() -> str:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no headless browser: install Debian's `chromium` package (apt-get install -y chromium)")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    root = tmp_path_factory.mktemp("board")
    private, _ = R.keypair(root / "reports" / "keys")
    (root / "reports" / "keys" / "vendor.key").unlink()
    R.store(R.signed(R.report("certified"), private), root / "reports" / "vllm-cuda.json.xz")
    R.store(R.report(None, engine="sglang", device="cpu", dtype="float32"), root / "reports" / "sglang-cpu.json.gz")
    tampered = R.signed(R.report("certified", routing_fails=False, engine="openvino", device="cpu"), private)
    tampered["environment"]["engine"]["version"] = "openvino 2.0"  # relabelled after signing
    R.store(tampered, root / "reports" / "openvino-cpu.json")
    revoked = R.report("certified", suite="0.0.9")  # the vllm product at an older suite version
    R.store(revoked, root / "reports" / "vllm-cuda-older.json")
    (root / "reports" / "revoked.toml").write_text(
        f'[[revoked]]\ndigest = "{revoked["digest"]["sha256"]}"\nreason = "ran a patched build"\n')
    build.write_site(build.read_board(root / "reports"), root / "site")
    return root / "site"


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    b = Browser(_executable(), str(tmp_path_factory.mktemp("profile")))
    yield b
    b.close()


@pytest.fixture
def page(browser, site):
    """Open a page of the site; at the end, nothing was logged to the console or thrown."""
    browser.events.clear()

    def open_(name: str):
        browser.open((site / name).as_uri() if "?" not in name else (site / name.split("?")[0]).as_uri()
                     + "?" + name.split("?", 1)[1])
        return browser

    yield open_
    assert browser.problems() == []


def test_console_capture_is_live(browser, tmp_path):
    """Control: a page that logs and throws is caught, so the clean pages below mean something."""
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><p>x</p><script>console.error('boom'); nope();</script></body></html>")
    browser.events.clear()
    browser.open(bad.as_uri())
    problems = browser.problems()
    assert any("boom" in p for p in problems) and any("nope is not defined" in p for p in problems), problems


COLUMNS = "Array.from(document.querySelectorAll('#board thead th.col')).filter(th => !th.hidden)"
ROWS = "Array.from(document.querySelectorAll('#board tbody tr')).filter(tr => !tr.hidden)"


def test_the_matrix_renders(page):
    b = page("index.html")
    heads = b.run(f"{COLUMNS}.map(th => [th.dataset.engine, th.querySelector('.counts').textContent])")
    assert heads == [["openvino", "2 passed, 1 waived / 4"], ["sglang", "1 passed, 1 xfail / 4"],
                     ["vllm", "1 passed, 1 waived / 4"], ["vllm", "1 passed, 1 waived / 4"]]
    assert b.run(f"{COLUMNS}.map(th => th.dataset.suite)") == ["0.1.0", "0.1.0", "0.0.9", "0.1.0"]
    cells = b.run(f"{ROWS}.map(tr => [tr.dataset.feature, Array.from(tr.cells).slice(1).map(td => td.innerText)])")
    assert dict(cells)["mixed_batch/nearest_reference_routing"] == ["passed", "failed", "failed", "failed"]
    assert dict(cells)["dora/dora"] == ["waived", "xfail", "waived", "waived"]
    assert b.run("document.getElementById('board').getBoundingClientRect().width") > 400
    assert b.run("getComputedStyle(document.querySelector('.st-waived')).backgroundColor") == "rgb(219, 231, 251)"
    assert b.run("document.getElementById('shown').textContent") == "4 of 4 columns, 4 features"
    b = page("aligned.html")  # suite 0.1.0 only: vllm alone ran 0.0.9
    assert b.run(f"{COLUMNS}.map(th => th.dataset.engine + ' ' + th.dataset.suite)") == [
        "openvino 0.1.0", "sglang 0.1.0", "vllm 0.1.0"]


def test_the_filters_choose_columns_and_rows(page):
    b = page("index.html")
    b.run("const s = document.getElementById('filter-engine'); s.value = 'sglang';"
          "s.dispatchEvent(new Event('change')); 0")
    assert b.run(f"{COLUMNS}.map(th => th.dataset.engine)") == ["sglang"]
    assert b.run(f"{ROWS}.every(tr => Array.from(tr.cells).filter(td => !td.hidden).length === 2)")
    b.run("const t = document.getElementById('filter-status'); t.value = 'failed';"
          "t.dispatchEvent(new Event('change')); 0")
    assert b.run(f"{ROWS}.map(tr => tr.dataset.feature)") == ["mixed_batch/nearest_reference_routing"]
    assert b.run("document.getElementById('shown').textContent") == "1 of 4 columns, 1 features"
    # The query string chooses the same on load (a filtered view can be linked).
    b = page("index.html?device=cuda&status=waived")
    assert b.run(f"{COLUMNS}.map(th => th.dataset.engine)") == ["vllm", "vllm"]
    assert b.run(f"{ROWS}.map(tr => tr.dataset.feature)") == ["dora/dora"]
    assert b.run("document.getElementById('view-aligned').search") == "?device=cuda&status=waived"


def test_a_failure_links_to_its_case_with_its_diagnosis_and_plot(page):
    b = page("index.html")
    href = b.run("document.querySelector('#board tr[data-feature=\"mixed_batch/nearest_reference_routing\"] "
                 "td[data-status=failed]:last-child a').href")
    assert "/r/vllm-cuda.html#case-" in href
    b.open(href)
    target = b.run("(() => { const t = document.querySelector(':target'); return t && {"
                   "cls: t.className, text: t.innerText, svg: t.querySelectorAll('svg circle').length,"
                   "top: t.getBoundingClientRect().top,"
                   "cause: t.closest('section.cause').querySelector('h3').innerText}; })()")
    assert target["cls"] == "failure" and R.ROUTING in target["text"] and "slot 1 got no adapter" in target["text"]
    assert R.DIAGNOSIS in target["cause"]
    assert target["svg"] > 10  # the effects plot of the failing case
    assert abs(target["top"]) < 80  # scrolled to it
    assert "verified" in b.run("document.querySelector('.sb-banner').innerText")
    assert R.ISSUE in b.run("Array.from(document.querySelectorAll('#certification ~ table a')).map(a => a.href)"
                            ".join(' ')")  # the waiver's issue, in report.html's certification section


def test_a_tampered_report_is_marked(page):
    b = page("index.html")
    head = b.run("(() => { const th = document.querySelector('#board th[data-engine=openvino]');"
                 "const mark = th.querySelector('.integrity');"
                 "return [th.className, mark.textContent, getComputedStyle(mark).backgroundColor]; })()")
    assert head == ["col integrity-tampered", "tampered", TAMPERED_RED]
    assert b.run("document.querySelector('#board td.integrity-tampered') !== null")
    b = page("r/openvino-cpu.html")
    banner = b.run("document.querySelector('.sb-banner').innerText")
    assert "tampered" in banner and "signature does not match" in banner


def test_a_revoked_report_is_struck_through_with_its_reason(page):
    b = page("index.html")
    th = b.run("(() => { const th = document.querySelector('#board th.revoked');"
               "return [th.className, getComputedStyle(th.querySelector('a')).textDecorationLine,"
               "th.querySelector('.why').textContent,"
               "getComputedStyle(document.querySelector('#board td.revoked .status')).textDecorationLine]; })()")
    assert th == ["col integrity-unverified revoked", "line-through", "revoked: ran a patched build", "line-through"]


@pytest.fixture(scope="module")
def stored_site(tmp_path_factory):
    """The site of the stored reports (reports/), as the workflow builds it."""
    from pathlib import Path

    out = tmp_path_factory.mktemp("stored") / "site"
    b = build.read_board(Path(__file__).resolve().parents[1] / "reports")
    build.write_site(b, out)
    return out, b


def test_the_stored_reports_site_renders_and_every_failure_link_resolves(browser, stored_site):
    site_dir, b = stored_site
    browser.events.clear()
    browser.open((site_dir / "index.html").as_uri())
    assert browser.run(f"{COLUMNS}.length") == len(b.columns)
    tampered = browser.run(f"{COLUMNS}.filter(th => th.classList.contains('integrity-tampered')).length")
    assert tampered == sum(c.integrity.tampered for c in b.columns)
    links = browser.run("Array.from(document.querySelectorAll('#board td[data-status=failed] a')).map(a => a.href)")
    assert links, "the stored reports have failed features (pick another example if none is left)"
    for href in links:
        browser.open(href)
        target = browser.run("(() => { const t = document.querySelector(':target');"
                             "return t && [t.className, t.closest('section.cause') !== null]; })()")
        assert target == ["failure", True], href
    assert browser.problems() == []
