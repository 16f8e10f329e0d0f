"""The web UI in a real browser: Debian's headless `chromium`, driven by Playwright, against `pagoda serve` on
the built-in model with an API key (so every page also goes through the key flow).

Where a test needs the model to say something particular, it adds vLLM fields to the page's own request
on its way out (Playwright's request routing): `ignore_eos` for a long answer, `structured_outputs.choice`
for an answer that is exactly some HTML. Without chromium the tests are skipped, except on CI (`CI` set),
where that is a failure: `.ci/run` installs it.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Iterator

import httpx
import pytest
from playwright.sync_api import Browser, Locator, Page, Route, sync_playwright
from server_fixtures import start_server

from pagoda.demo import DEMO_EXAMPLES, DEMO_INTRO
from pagoda.server.state import ServerState
from pagoda.server.web import intro_body

pytestmark = pytest.mark.timeout(180)

KEY = "web-ui-key"
UI_TIMEOUT_MS = 20_000
LONG_ANSWER_TOKENS = 400  # the built-in model's context is 512 tokens
FINISHED = "vllm:request_success_total"  # by finished_reason
HOSTILE = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2"> & <b>bold</b>'


def chromium_executable() -> str:
    path = os.environ.get("PAGODA_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        message = "no chromium binary: `apt-get install chromium` (.ci/run installs it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    executable = chromium_executable()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, headless=True)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_server(None, tmp_path_factory.mktemp("web-ui"), "--threads", "1", "--num-kv-blocks", "256",
                          api_key=KEY)
    yield server
    server.stop()


@pytest.fixture
def page(browser: Browser, server) -> Iterator[Page]:
    """A tab that already holds the API key (the key dialog itself is tested on its own), failing the test
    on any uncaught script error or content-security-policy violation."""
    context = browser.new_context(base_url=server.url, viewport={"width": 1200, "height": 800})
    context.add_init_script(f"sessionStorage.setItem('pagoda-api-key', {json.dumps(KEY)})")
    context.set_default_timeout(UI_TIMEOUT_MS)
    page = context.new_page()
    problems: list[str] = []
    page.on("pageerror", lambda error: problems.append(f"uncaught: {error}"))
    page.on("console", lambda message: problems.append(message.text)
            if "Content Security Policy" in message.text else None)
    yield page
    context.close()
    assert not problems, problems


def wait_for_text(page: Page, selector: str, condition: str) -> None:
    """Waits until `condition`, a JavaScript function of the element's text, holds. A function, not an
    expression: Playwright evaluates expressions with eval, which the pages' security policy refuses."""
    page.wait_for_function(f"(selector) => ({condition})(document.querySelector(selector)?.textContent ?? '')",
                           arg=selector)


def open_chat(page: Page) -> str:
    page.goto("/")
    wait_for_text(page, "#model-name", "text => text !== '…'")
    return page.text_content("#model-name") or ""


def add_to_requests(page: Page, **fields) -> list[dict]:
    """Merges `fields` into every chat request the page sends; returns the list of bodies as sent."""
    sent: list[dict] = []

    def amend(route: Route) -> None:
        body = {**json.loads(route.request.post_data or "{}"), **fields}
        sent.append(body)
        route.continue_(post_data=json.dumps(body))

    page.route("**/v1/chat/completions", amend)
    return sent


def ask(page: Page, question: str) -> None:
    page.fill("#prompt", question)
    page.press("#prompt", "Enter")


def last_answer(page: Page) -> Locator:
    return page.locator(".message.assistant").last


def record_answer_lengths(page: Page) -> None:
    """window.__lengths: the last answer's text length at every change the page makes to it."""
    page.evaluate("""() => {
        window.__lengths = [];
        new MutationObserver(() => {
            const answers = document.querySelectorAll('.message.assistant .content');
            if (answers.length) window.__lengths.push(answers[answers.length - 1].textContent.length);
        }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
    }""")


# --- chat ---------------------------------------------------------------------------------------------


def test_the_page_answers_as_the_api_does_and_shows_ttft_and_tokens_per_second(page: Page, server):
    assert open_chat(page) == server.get("/v1/models").json()["data"][0]["id"]
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "48")
    ask(page, "What is 12 + 35?")
    answer = last_answer(page)
    answer.and_(page.locator("[data-state=done]")).wait_for()
    expected = server.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "What is 12 + 35?"}], "temperature": 0, "max_tokens": 48,
    }).json()["choices"][0]["message"]["content"]
    assert answer.locator(".content").text_content() == expected
    meta = answer.locator(".meta").text_content() or ""
    assert "TTFT" in meta and "finish: stop" in meta, meta
    assert float(answer.get_attribute("data-ttft-ms") or "nan") > 0


def test_the_built_in_model_says_what_it_can_do_and_its_examples_are_answered_on_a_click(page: Page):
    open_chat(page)
    wait_for_text(page, "#intro-text", f"text => text === {json.dumps(DEMO_INTRO)}")
    examples = page.locator("#intro-examples button")
    assert examples.all_text_contents() == list(DEMO_EXAMPLES)
    page.fill("#temperature", "0")
    for index, (question, answer) in enumerate(DEMO_EXAMPLES.items()):
        if index:
            page.click("#new-chat")  # each example opens a conversation
        assert page.locator("#intro").is_visible()
        examples.nth(index).click()
        last_answer(page).and_(page.locator("[data-state=done]")).wait_for()
        assert page.locator(".message.user .content").all_text_contents() == [question]
        assert last_answer(page).locator(".content").text_content() == answer
        assert not page.locator("#intro").is_visible()


# Three families in one conversation, the last question about the first turn: the built-in model answers
# each from the whole history the page sends.
CONVERSATION = (
    ("My name is Rex.", "Nice to meet you, Rex."),
    ("What is 250 + 89?", "339"),
    ("Reverse the list: red, tea, oslo", "oslo, tea, red"),
    ("What is my name?", "Rex"),
)


def test_a_conversation_is_answered_turn_by_turn_and_each_request_carries_every_earlier_turn(page: Page):
    open_chat(page)
    page.fill("#temperature", "0")
    sent = add_to_requests(page)
    for turn, (question, answer) in enumerate(CONVERSATION):
        ask(page, question)
        page.locator(".message.assistant").nth(turn).and_(page.locator("[data-state=done]")).wait_for()
        assert last_answer(page).locator(".content").text_content() == answer, question
    earlier: list[tuple[str, str]] = []
    for body, (question, answer) in zip(sent, CONVERSATION, strict=True):
        assert [(m["role"], m["content"]) for m in body["messages"]] == [*earlier, ("user", question)]
        earlier += [("user", question), ("assistant", answer)]


def test_the_introduction_is_the_built_in_models_alone(server):
    assert httpx.get(f"{server.url}/chat/intro", timeout=10).status_code == 401  # guarded like the API
    assert server.get("/chat/intro").json() == {"intro": DEMO_INTRO, "examples": list(DEMO_EXAMPLES)}
    assert intro_body(ServerState(model_name="another")) == {"intro": None, "examples": []}


def test_an_answer_streams_in_and_the_settings_reach_the_request(page: Page):
    open_chat(page)
    sent = add_to_requests(page, ignore_eos=True)
    page.fill("#system-prompt", "Answer briefly.")
    page.fill("#temperature", "0.5")
    page.fill("#top-p", "0.9")
    page.fill("#max-tokens", "40")
    page.fill("#seed", "7")
    page.fill("#stop", "never-said-1\nnever-said-2")
    record_answer_lengths(page)
    ask(page, "Count to five.")
    answer = page.locator(".message.assistant").nth(0)
    answer.and_(page.locator("[data-state=done]")).wait_for()
    body = sent[-1]
    assert body["messages"] == [{"role": "system", "content": "Answer briefly."},
                                {"role": "user", "content": "Count to five."}]
    assert (body["temperature"], body["top_p"], body["max_tokens"], body["seed"]) == (0.5, 0.9, 40, 7)
    assert body["stop"] == ["never-said-1", "never-said-2"] and body["stream"] is True
    lengths = [n for n in page.evaluate("window.__lengths") if n > 0]
    assert len(set(lengths)) >= 3 and lengths == sorted(lengths), lengths  # it grew, chunk by chunk
    meta = answer.locator(".meta").text_content() or ""
    assert "40 tokens" in meta and "tok/s" in meta and "finish: length" in meta, meta
    # The next question carries the conversation so far.
    ask(page, "And to six?")
    page.locator(".message.assistant").nth(1).and_(page.locator("[data-state=done]")).wait_for()
    history = sent[-1]["messages"]
    assert [m["role"] for m in history] == ["system", "user", "assistant", "user"]
    assert history[2]["content"] == answer.locator(".content").text_content()
    # New chat: an empty page and a conversation that starts again.
    page.click("#new-chat")
    assert page.locator(".message").count() == 0
    ask(page, "Once more.")
    last_answer(page).and_(page.locator("[data-state=done]")).wait_for()
    assert [m["role"] for m in sent[-1]["messages"]] == ["system", "user"]


def test_stop_ends_the_answer_and_the_server_aborts_the_request(page: Page, server):
    open_chat(page)
    add_to_requests(page, ignore_eos=True, max_tokens=LONG_ANSWER_TOKENS)
    before = server.metrics()
    aborted, ran_out = (before.value(FINISHED, finished_reason=reason) for reason in ("abort", "length"))
    ask(page, "Tell me a long story.")
    answer = last_answer(page)
    wait_for_text(page, ".message.assistant:last-child .content", "text => text.length > 0")
    page.click("#stop-button")
    answer.and_(page.locator("[data-state=stopped]")).wait_for()
    assert "stopped" in (answer.locator(".meta").text_content() or "")
    assert page.is_enabled("#send") and page.is_disabled("#stop-button")
    server.wait_for_metrics(lambda m: m.value(FINISHED, finished_reason="abort") == aborted + 1,
                            "the stopped request counted as aborted")
    server.wait_until_idle()
    assert server.metrics().value(FINISHED, finished_reason="length") == ran_out  # it never ran out of tokens


def test_html_in_model_output_is_shown_as_text(page: Page):
    open_chat(page)
    add_to_requests(page, structured_outputs={"choice": [HOSTILE]}, max_tokens=200)
    ask(page, "Say something dangerous.")
    answer = last_answer(page)
    answer.and_(page.locator("[data-state=done]")).wait_for()
    assert answer.locator(".content").text_content() == HOSTILE
    assert page.locator("#messages script, #messages img, #messages b").count() == 0
    assert page.evaluate("window.__pwned") is None
    # The renderer on its own: code fences become <pre><code>, filled as text too.
    rendered = page.evaluate("""(text) => {
        const box = document.createElement('div');
        pagodaRender.renderText(box, text);
        return {tags: [...box.querySelectorAll('*')].map(e => e.tagName), code: box.querySelector('code').textContent,
                text: box.textContent};
    }""", f"before\n```html\n{HOSTILE}\n```\nafter {HOSTILE}")
    assert rendered["tags"] == ["PRE", "CODE"]
    assert rendered["code"] == HOSTILE + "\n" and rendered["text"] == f"before\n{HOSTILE}\n\nafter {HOSTILE}"
    assert page.evaluate("window.__pwned") is None


def test_the_page_asks_for_the_api_key_and_sends_it(browser: Browser, server):
    context = browser.new_context(base_url=server.url)
    context.set_default_timeout(UI_TIMEOUT_MS)
    try:
        page = context.new_page()
        page.goto("/")
        dialog = page.locator("#key-dialog")
        dialog.and_(page.locator("[open]")).wait_for()
        assert "needs an API key" in (dialog.locator(".key-message").text_content() or "")
        page.fill("#key-input", "wrong-key")
        page.click("#key-dialog button[value=ok]")
        wait_for_text(page, "#key-dialog .key-message", "text => text.includes('refused')")
        with page.expect_request("**/v1/models") as models_request:
            page.fill("#key-input", KEY)
            page.click("#key-dialog button[value=ok]")
        assert models_request.value.headers["authorization"] == f"Bearer {KEY}"
        wait_for_text(page, "#model-name", "text => text !== '…'")
        assert page.evaluate("sessionStorage.getItem('pagoda-api-key')") == KEY
        with page.expect_request("**/v1/chat/completions") as chat_request:
            ask(page, "hi")
        assert chat_request.value.headers["authorization"] == f"Bearer {KEY}"
        last_answer(page).and_(page.locator("[data-state=done]")).wait_for()
    finally:
        context.close()


# --- dashboard ----------------------------------------------------------------------------------------


def keep_busy(server, stop: threading.Event, started: threading.Event) -> None:
    """Long streamed chat requests, one after another, until `stop` (leaving a stream closes it: the server
    aborts that request). However fast the machine, a request is running whenever the dashboard looks."""
    body = {"messages": [{"role": "user", "content": "Go on."}], "ignore_eos": True,
            "max_tokens": LONG_ANSWER_TOKENS, "stream": True}
    with server.http() as http:
        while not stop.is_set():
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                for _ in response.iter_lines():
                    started.set()
                    if stop.is_set():
                        return


def tile(page: Page, name: str) -> str:
    return page.text_content(f"#{name} .value") or ""


def test_the_dashboards_numbers_move_while_requests_run(page: Page, server):
    server.wait_until_idle()
    page.goto("/dashboard?refresh=200")
    wait_for_text(page, "#running .value", "text => text === '0'")
    requests_before = int(tile(page, "requests"))
    stop, started = threading.Event(), threading.Event()
    worker = threading.Thread(target=keep_busy, args=(server, stop, started), daemon=True)
    worker.start()
    try:
        assert started.wait(30), "the request never streamed"
        wait_for_text(page, "#running .value", "text => Number(text) >= 1")
        wait_for_text(page, "#tokens-per-s .value", "text => parseFloat(text) > 0")
        wait_for_text(page, "#requests .value", f"text => Number(text) > {requests_before}")
        wait_for_text(page, "#kv-usage .value", "text => text !== '0.0 %'")
        assert tile(page, "itl") != "–" and worker.is_alive()  # all seen while requests ran
    finally:
        stop.set()
        worker.join(30)
    wait_for_text(page, "#running .value", "text => text === '0'")
    assert "Cannot" not in (page.text_content("#dashboard-status") or "")
    assert page.is_hidden("#kv-tiers"), "no KV connector: no tiers panel (tests/test_web_kv_tiers.py has one)"
    for chart in ("requests", "kv", "tokens", "prefix", "ttft", "itl"):  # every chart has points to draw
        assert int(page.get_attribute(f"#chart-{chart}", "data-points") or 0) > 0, chart


def test_the_stats_route_needs_the_key(server):
    assert httpx.get(f"{server.url}/dashboard/stats", timeout=10).status_code == 401
    stats = server.get("/dashboard/stats").json()
    assert stats["model"] == server.get("/v1/models").json()["data"][0]["id"]
    assert {"running", "waiting", "kv_cache_usage", "prefix_cache_hits", "prefix_cache_queries", "recent"} <= set(stats)
    assert stats["kv_tiers"] is None
    assert httpx.get(f"{server.url}/", timeout=10).status_code == 200  # the page itself needs no key


def calc_rows(page: Page) -> list[tuple[str, str]]:
    """The calculator page's figures as shown: (label, value) of every section row."""
    return [(row.locator("th").text_content() or "", row.locator("td.value").text_content() or "")
            for row in page.locator(".calc-part tr[data-key]").all()]


def cli_line_of(text: str, label: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(f"  {label}  "))


def test_the_calculators_batch_slider_shows_the_clis_figures_for_that_batch(page: Page):
    import io
    from contextlib import redirect_stdout

    from pagoda.calc.cli import main as calc_main

    def cli(*argv: str) -> str:
        out = io.StringIO()
        with redirect_stdout(out):
            calc_main(list(argv))
        return out.getvalue()

    page.goto("/calc")
    page.wait_for_function("() => document.body.dataset.calcSequence !== undefined")
    before = calc_rows(page)
    page.locator("#batch").evaluate("(slider) => { slider.value = '64'; "
                                    "slider.dispatchEvent(new Event('input', {bubbles: true})); }")
    page.wait_for_function("() => [...document.querySelectorAll('.calc-part h2')]"
                           ".some((h) => h.textContent === 'Roofline (decode, batch 64)')")
    after = calc_rows(page)
    assert after != before
    expected = cli("--batch", "64")
    for label, value in after:
        line = cli_line_of(expected, label)
        assert line[2:].split("  ", 1)[1].strip().startswith(value), (label, value, line)
    assert page.locator("#roofline circle.chosen").count() == 1
    assert page.locator("#batch-value").text_content() == "64"


def test_the_calculator_knows_the_served_model(page: Page, server):
    page.goto("/calc")
    page.wait_for_function("() => document.body.dataset.calcSequence !== undefined")
    page.select_option("#model", "served")
    page.wait_for_function("() => [...document.querySelectorAll('.calc-part th')]"
                           ".some((th) => th.textContent === 'architecture')"
                           " && document.querySelector('tr[data-key=model] td.value').textContent === "
                           "'the served model'")
    for path, method in (("/calc/presets", "GET"), ("/calc/report", "POST")):  # guarded like the API
        assert httpx.request(method, f"{server.url}{path}", json={}, timeout=10).status_code == 401
    assert httpx.get(f"{server.url}/calc", timeout=10).status_code == 200
