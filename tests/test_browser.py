"""JupyterLab as people use it: headless Chromium runs notebook 01, moves its widget, sees its figure.

The browser is Debian's `chromium` (make setup installs it where it can), driven by Playwright's Python
package with `executable_path`: nothing is downloaded. The server is `tools.lab` (what `make lab` runs)
on 127.0.0.1, serving a temporary copy of the notebook (JupyterLab autosaves outputs into what it opens).
Screenshots go to screenshots/ (ignored by git). Marked `engine` as well as `browser`, so the fast tier
(`make test-fast`, `-m "not engine"`) skips it: it takes a JupyterLab start plus a full notebook run.
"""

import json
import os
import secrets
import shutil
import socket
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from rla_lib import rounding
from tools import lab
from rla_lib.paths import ROOT

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
NOTEBOOK = "01_rounding_toy.ipynb"
SCREENSHOTS = ROOT / "screenshots"
# As root in a container; the rest keep Chromium off this machine's closed network (refused connections).
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# JupyterLab settings for the test's own settings folder: every cell in the DOM (no windowing), no news toasts.
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false", "checkForUpdates": False},
}
RUN_ALL_TIMEOUT_S = 900  # a hang guard on a loaded 2-core machine, not a timing assertion
KERNEL_START_TIMEOUT_S = 600  # the same kind of guard for the kernel's start
PANEL = ".jp-NotebookPanel:not(.lm-mod-hidden)"


# ---- tools.lab without a browser -------------------------------------------------------------
def test_a_taken_port_is_skipped():
    with socket.socket() as s:
        s.bind((lab.HOST, 0))
        s.listen()
        taken = s.getsockname()[1]
        assert not lab.port_is_free(taken)
        assert lab.free_port(taken) > taken


def test_a_missing_kernel_names_make_setup():
    with pytest.raises(lab.KernelMissing, match="make setup"):
        lab.require_kernel("rla-no-such-kernel")


def test_lab_listens_on_localhost_with_the_rla_kernel():
    cmd = lab.lab_command(8888, "t", ROOT / "notebooks")
    assert f"--ServerApp.ip={lab.HOST}" in cmd and lab.HOST == "127.0.0.1"
    assert f"--MappingKernelManager.default_kernel_name={lab.KERNEL}" in cmd
    assert lab.kernel_installed(), "the rla kernel is missing: run make setup"


SLOW_KERNEL_S = 6  # a kernel start delayed well past jupyter_client's 1 s heartbeat allowance


def test_a_kernel_without_a_heartbeat_yet_is_waited_for(tmp_path):
    """A kernel that takes longer to start than the heartbeat allows (as under load) is waited for, not declared dead:
    `wait_for_ready` gives up on it, `wait_for_kernel_info` gets its answer."""
    import subprocess
    import sys

    from jupyter_client import BlockingKernelClient
    from jupyter_client.connect import write_connection_file

    connection_file, _ = write_connection_file(str(tmp_path / "kernel.json"))
    delayed = ("import sys, time; time.sleep(float(sys.argv.pop(1))); "
               "from ipykernel import kernelapp; kernelapp.launch_new_instance()")
    kernel = subprocess.Popen([sys.executable, "-c", delayed, str(SLOW_KERNEL_S), "-f", connection_file],
                              env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for waits in ("jupyter_client", "ours"):
            client = BlockingKernelClient(connection_file=connection_file)  # not a manager's: as in the browser test
            client.load_connection_file()
            client.start_channels(hb=waits == "jupyter_client")
            try:
                if waits == "jupyter_client":
                    with pytest.raises(RuntimeError, match="died"):
                        client.wait_for_ready(timeout=60)
                else:
                    wait_for_kernel_info(client, lambda: "starting" if kernel.poll() is None else "dead",
                                         poll_s=1, timeout_s=120)
            finally:
                client.stop_channels()
    finally:
        kernel.kill()
        kernel.wait()


# ---- the browser ---------------------------------------------------------------------------------
@pytest.fixture
def chromium():
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        pytest.skip(f"no Chromium at {CHROMIUM}: `make setup` installs it as root with apt-get, "
                    "or install it with `sudo apt-get install chromium`")
    pytest.importorskip("playwright.sync_api", reason="playwright is missing: run `make setup`")
    return CHROMIUM


@pytest.fixture
def lab_server(tmp_path):
    """JupyterLab (tools.lab) on a free port with a test token, serving a copy of notebook 01: (port, token, runtime dir)."""
    root = tmp_path / "notebooks"
    root.mkdir()
    shutil.copy(ROOT / "notebooks" / NOTEBOOK, root / NOTEBOOK)
    settings = tmp_path / "lab-settings"
    for name, values in LAB_SETTINGS.items():
        (settings / os.path.dirname(name)).mkdir(parents=True, exist_ok=True)
        (settings / name).write_text(json.dumps(values))
    # The kernel's IPC sockets are files in the runtime folder, whose path must stay under the 107 bytes a Unix socket
    # address allows: pytest's tmp_path under xdist is too long (ZMQError "File name too long"), so a short one in /tmp.
    runtime = tempfile.mkdtemp(prefix="rla-lab-", dir="/tmp")
    env = dict(os.environ, OMP_NUM_THREADS="1", JUPYTER_RUNTIME_DIR=runtime,
               RLA_FIGURES_DIR=str(tmp_path / "figures"), RLA_RESULTS_DIR=str(tmp_path / "results"),
               RLA_TABLES_DIR=str(tmp_path / "tables"))  # the kernel inherits these: figures stay out of the repo
    port, token = lab.free_port(lab.DEFAULT_PORT + 100), secrets.token_hex(16)
    # IPC, not TCP, between server and kernel: no kernel port can be taken meanwhile by an engine in another test
    extra = [f"--LabApp.user_settings_dir={settings}", f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}", "--no-browser",
             "--KernelManager.transport=ipc",
             # the server presumes a kernel dead after 60 s without a kernel_info reply; a loaded machine takes longer
             f"--MappingKernelManager.kernel_info_timeout={KERNEL_START_TIMEOUT_S}"]
    log = open(tmp_path / "lab.log", "w", buffering=1)
    # INFO: kernel starts, restarts and shutdowns go into lab.log, for the report of a failing run
    proc = lab.start(root, port, token, extra, env=env, log_level="INFO", stdout=log, stderr=log)
    try:
        lab.wait_until_ready(proc, port, token)
        yield port, token, Path(runtime)
    finally:
        lab.stop(proc)
        log.close()
        shutil.rmtree(runtime, ignore_errors=True)


def lab_api(port, token, path, body=None):
    """One call to the server's REST API (GET, or POST with a JSON body)."""
    request = urllib.request.Request(lab.lab_url(port, token, path), method="GET" if body is None else "POST",
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def start_kernel_session(port, token, path, runtime_dir):
    """The notebook's session with the rla kernel, started through the REST API and answering before the page opens.

    The page then joins a running kernel. Left to the page, a kernel start slowed by a loaded machine can end in
    JupyterLab's "Select Kernel" dialog instead (seen once in CI). The server reports a kernel "starting" until a
    client asks it something, so the check is a kernel_info request of our own, over the kernel's connection file."""
    from jupyter_client import BlockingKernelClient

    session = lab_api(port, token, "api/sessions", {"path": path, "name": path, "type": "notebook",
                                                    "kernel": {"name": lab.KERNEL}})
    kernel_id = session["kernel"]["id"]
    client = BlockingKernelClient(connection_file=str(runtime_dir / f"kernel-{kernel_id}.json"))
    client.load_connection_file()
    client.start_channels(hb=False)  # see wait_for_kernel_info: no heartbeat
    try:
        wait_for_kernel_info(client, lambda: server_kernel_state(port, token, kernel_id))
    finally:
        client.stop_channels()
    return kernel_id


def server_kernel_state(port, token, kernel_id) -> str:
    """The kernel's execution_state as the server lists it ('gone' if it is not listed)."""
    return {k["id"]: k["execution_state"] for k in lab_api(port, token, "api/kernels")}.get(kernel_id, "gone")


def wait_for_kernel_info(client, kernel_state, poll_s=5.0, timeout_s=KERNEL_START_TIMEOUT_S):
    """Until the kernel answers a kernel_info request. It counts as dead only when `kernel_state()` (the server's word,
    which JupyterLab goes by) says so. Not jupyter_client's `wait_for_ready`: it gives up as soon as the heartbeat misses
    a beat, and a kernel still importing on a loaded 2-core machine has none yet ("Kernel died before replying to
    kernel_info" while the server listed it 'starting': an AVX2-only machine with the other test worker running engines)."""
    from queue import Empty

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        client.kernel_info()  # unanswered requests queue up in the kernel; any reply shows it answers
        try:
            while client.get_shell_msg(timeout=poll_s)["msg_type"] != "kernel_info_reply":
                pass
            return
        except Empty:
            if (state := kernel_state()) in ("dead", "gone"):
                raise RuntimeError(f"the kernel is {state} and never answered kernel_info") from None
    raise TimeoutError(f"the kernel did not answer kernel_info within {timeout_s} s")


def run_all(page, kernel_id, attempts=5):
    """Run > Run All Cells, again if no cell starts (the menu command stays disabled until the kernel is ready)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout  # installed where the browser tests run

    prompts = page.locator(f"{PANEL} .jp-CodeCell .jp-InputArea-prompt")
    for _ in range(attempts):
        dismiss_dialogs(page, kernel_id)
        try:  # a dialog appearing now takes the click: dismiss it on the next attempt
            page.locator("#jp-MainMenu .lm-MenuBar-itemLabel", has_text="Run").first.click(timeout=15_000)
            page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click(timeout=15_000)
        except PlaywrightTimeout:
            continue
        for _ in range(60):
            if any(t.strip() != "[ ]:" for t in prompts.all_inner_texts()):
                return
            page.wait_for_timeout(1000)
        page.keyboard.press("Escape")
    dismiss_dialogs(page, kernel_id)
    raise AssertionError(f"Run All Cells started no cell in {attempts} attempts")


def dismiss_dialogs(page, kernel_id) -> None:
    """Accept a modal dialog JupyterLab put up: it would take every click. What a dialog said is printed, for the log of
    a failing run. A kernel choice is answered with the test's running kernel where the list offers it ("Connect to
    Existing Kernel"): starting another instead shuts the current one down, and under load that loops (seen in CI,
    ten dialogs in 15 min, each new kernel interrupted while it still imported). Otherwise the rla kernel."""
    dialogs = page.locator(".jp-Dialog")
    for _ in range(5):
        if not dialogs.count():
            return
        print("JupyterLab dialog:", " ".join(dialogs.first.inner_text().split()))
        kernel_choice = dialogs.first.locator("select")
        if kernel_choice.count():
            kernel_choice.first.select_option(label=kernel_option(kernel_choice.first, kernel_id))
        accept = dialogs.first.locator(".jp-Dialog-button.jp-mod-accept")
        if accept.count():
            accept.first.click()
        else:
            page.keyboard.press("Escape")
        page.wait_for_timeout(500)


def kernel_option(select, kernel_id) -> str:
    """The label of the kernel list's entry for `kernel_id` (JupyterLab writes "name (first part of the id)"), else
    the rla kernel's."""
    labels = [text.strip() for text in select.evaluate("s => Array.from(s.options).map(o => o.text)")]
    running = [text for text in labels if text.endswith(f"({kernel_id.split('-')[0]})")]
    return running[0] if running else "Python (rla)"


def wait_until_page_joins(page, port, token, kernel_id):
    """Until the server counts a connection to the test's kernel: the page's own (ours was closed). A kernel dialog
    meanwhile is answered with that kernel."""
    deadline = time.monotonic() + KERNEL_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if any(k["id"] == kernel_id and k["connections"] > 0 for k in lab_api(port, token, "api/kernels")):
            return
        dismiss_dialogs(page, kernel_id)
        page.wait_for_timeout(1000)
    raise TimeoutError(f"the page did not connect to kernel {kernel_id} within {KERNEL_START_TIMEOUT_S} s")


def failure_report(log_path, port, token, kernel_id, console) -> str:
    """What a failing run's report needs: the server's kernels and warnings from the start (a tail alone missed how
    the trouble began), the end of its log and the page's console errors."""
    log = log_path.read_text()
    try:
        kernels = [(k["id"], k["execution_state"], k["connections"]) for k in lab_api(port, token, "api/kernels")]
    except OSError as e:
        kernels = f"(no answer: {e})"
    notable = [line for line in log.splitlines() if line.startswith(("[W", "[E", "[C")) or "Kernel " in line]
    return (f"the test's kernel: {kernel_id}; the server's kernels (id, state, connections): {kernels}\n"
            "JupyterLab's warnings and kernel events:\n" + "\n".join(notable)[:6000] +
            "\nthe end of JupyterLab's log:\n" + log[-3000:] + "\nthe page's console errors and warnings:\n" +
            "\n".join(console[-40:]))


def wait_for_run_all(page):
    """Until no code cell is queued or running and the first has run; then whether every one ran."""
    deadline = time.monotonic() + RUN_ALL_TIMEOUT_S
    while time.monotonic() < deadline:
        prompts = page.locator(f"{PANEL} .jp-CodeCell .jp-InputArea-prompt").all_inner_texts()
        if prompts and "[*]" not in "".join(prompts) and any(ch.isdigit() for ch in prompts[0]):
            return prompts
        page.wait_for_timeout(1000)
    raise TimeoutError(f"run-all did not finish within {RUN_ALL_TIMEOUT_S} s")


def printed_lines(locator) -> list[str]:
    return [line.strip() for line in locator.inner_text().strip().splitlines() if line.strip()]


def expected_lines(value, chain) -> list[str]:
    return [line.strip() for line in str(rounding.chain_rounding(value, chain)).splitlines()]


def wait_for_lines(locator, expected, timeout_s=180):
    deadline = time.monotonic() + timeout_s
    while printed_lines(locator) != expected and time.monotonic() < deadline:
        time.sleep(0.25)
    assert printed_lines(locator) == expected


@pytest.mark.browser
@pytest.mark.engine
def test_notebook_01_in_jupyterlab(chromium, lab_server, tmp_path):
    from playwright.sync_api import sync_playwright

    port, token, runtime = lab_server
    SCREENSHOTS.mkdir(exist_ok=True)
    new_value = 1.2  # 1.003 (the default) and 1.2 give different BF16 results after *3
    assert expected_lines(new_value, "*3") != expected_lines(1.003, "*3")
    with sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=chromium, headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": 1400, "height": 1000})
        page, kernel_id, console = None, "", []
        try:
            kernel_id = start_kernel_session(port, token, NOTEBOOK, runtime)
            page = browser.new_page()
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None)
            page.set_default_timeout(300_000)  # hang guards on a loaded 2-core machine (a kernel start can take minutes)
            page.goto(lab.lab_url(port, token, f"lab/tree/{NOTEBOOK}"))
            wait_until_page_joins(page, port, token, kernel_id)
            page.locator(f"{PANEL} .jp-Notebook-ExecutionIndicator[data-status='idle']").wait_for()

            run_all(page, kernel_id)
            prompts = wait_for_run_all(page)
            errors = page.locator(f"{PANEL} .jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
            assert all(any(ch.isdigit() for ch in t) for t in prompts), (
                f"run-all stopped: {prompts}\n" + "\n".join(errors.all_inner_texts())[-3000:])
            assert [k["id"] for k in lab_api(port, token, "api/kernels")] == [kernel_id], "the page started a kernel of its own"

            # the chapter's figure (the BF16 grid) rendered as an image in the page
            figure = page.locator(f"{PANEL} .jp-OutputArea-output img").first
            figure.scroll_into_view_if_needed()
            assert figure.evaluate("img => img.complete && img.naturalWidth > 100 && img.naturalHeight > 50")
            figure.screenshot(path=str(SCREENSHOTS / "01_figure.png"))

            # the live widget: its printed BF16 result follows the value typed into it
            interact = page.locator(f"{PANEL} .widget-interact").first
            output = interact.locator(".widget-output")
            interact.scroll_into_view_if_needed()
            wait_for_lines(output, expected_lines(1.003, "*3"))
            page.screenshot(path=str(SCREENSHOTS / "01_widget_before.png"))
            number = interact.locator("input[type='number']").first
            number.fill(str(new_value))
            number.press("Enter")
            wait_for_lines(output, expected_lines(new_value, "*3"))
            page.screenshot(path=str(SCREENSHOTS / "01_widget_after.png"))

            # a kernel dialog is answered with the running kernel: nothing is restarted, the notebook still runs
            page.locator("#jp-MainMenu .lm-MenuBar-itemLabel", has_text="Kernel").first.click()
            page.locator(".lm-Menu-itemLabel", has_text="Change Kernel").first.click()
            page.locator(".jp-Dialog select").wait_for()
            dismiss_dialogs(page, kernel_id)
            number.fill(str(new_value * 2))
            number.press("Enter")
            wait_for_lines(output, expected_lines(new_value * 2, "*3"))
            assert [k["id"] for k in lab_api(port, token, "api/kernels")] == [kernel_id], "the dialog's answer started a kernel"
        except Exception:
            if page is not None:
                page.screenshot(path=str(SCREENSHOTS / "01_failure.png"))  # what the page showed when the test failed
                dismiss_dialogs(page, kernel_id)  # prints any dialog's text into the failure report
            print(failure_report(tmp_path / "lab.log", port, token, kernel_id, console))
            raise
        finally:
            browser.close()


@pytest.mark.engine
@pytest.mark.browser
def test_the_measure_report_paints_every_token_and_orders_the_worst_prompts_first(chromium, tmp_path):
    """`rla measure --report`'s page in Chromium, from a file, nothing fetched: one painted token per response token,
    white where the two sides agree bit for bit, and a click orders the prompts by their worst |d|."""
    from playwright.sync_api import sync_playwright

    from test_mismatch_html import report

    run, _, _ = report(tmp_path)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page()
            errors, requests = [], []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: requests.append(r.url) if not r.url.startswith("file:") else None)
            page.goto((tmp_path / "report.html").as_uri())
            painted = page.eval_on_selector_all(".tok", "els => els.map(e => e.style.backgroundColor)")
            assert len(painted) == int(run.lengths.sum()) and all(painted), painted
            assert len(set(painted)) > 1  # stock differs by noise: not one colour
            page.select_option("#comparison", label="vLLM eager vs engine-aligned")
            assert set(page.eval_on_selector_all(".tok", "els => els.map(e => e.style.backgroundColor)")) == {"rgb(255, 255, 255)"}
            page.select_option("#comparison", label="vLLM eager vs stock BF16")
            given = page.eval_on_selector_all(".prompt", "els => els.map(e => +e.dataset.k)")
            page.click("#order")
            worst = page.eval_on_selector_all(".prompt", "els => els.map(e => +e.dataset.worst)")
            assert given == [0, 1, 2, 3] and worst == sorted(worst, reverse=True) and worst[0] > worst[-1]
            SCREENSHOTS.mkdir(exist_ok=True)
            page.screenshot(path=str(SCREENSHOTS / "measure-report.png"), full_page=True)
            assert not errors and not requests, (errors, requests)
        finally:
            browser.close()
