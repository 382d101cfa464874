"""The web console's pages for what the gateway runs, in a real browser (Debian's Chromium driven by Playwright)
against a real gateway over two real sandboxd nodes (services_world: a secrets key, an agents file, fast health
settings, and here an SSH listener): services (create from the form, scale, a rollout watched to its end, a
failing rollout shown with its reason, delete, the address), jobs and agent runs (submit, output followed live,
kept files downloaded, cancel), secrets (the value never in the page after saving), SSH (host key fingerprints,
the ssh command line and a token login, used by a real OpenSSH client; register and delete a key), a node cordoned
elsewhere shown without a reload, and hostile text (a command, a job's output, a key's comment) shown as text.
A screenshot of every page goes to test-artifacts/console/."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from console_harness import Tab, needs_browser
from gateway_harness import wait_for
from sandboxd_harness import free_port
from services_world import SERVE, SERVER, Receiver, World, world

from sbx.client.sync import Client

#: Milliseconds the browser waits for what a page shows (replicas boot, a rollout runs, a job ends).
WAIT_MS = 120_000
#: Markup a hostile name or output might carry: shown as text, it never runs (window.__pwned stays unset).
HOSTILE = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'

pytestmark = needs_browser


class Fleet:
    def __init__(self, w: World, ssh_port: int, dev_key: str) -> None:
        self.w, self.ssh_port, self.dev_key = w, ssh_port, dev_key
        self.url = f"http://127.0.0.1:{w.gw.port}"

    def api(self, method: str, path: str, body: Any = None, status: int = 200) -> Any:
        resp = self.w.gw.request(method, path, body, key=self.dev_key)
        assert resp.status == status, (method, path, resp.status, resp.body[:2000])
        return resp.json() if resp.body else None


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    ssh_port = free_port()
    with world(["--ssh-listen", f"127.0.0.1:{ssh_port}"], prefix="sbxconsolew-") as w:
        # alice of acme with every scope a developer uses, SSH included (the world's own alice has no SSH).
        scopes = ["sandbox:read", "sandbox:create", "sandbox:delete", "secrets:write", "sandbox:ssh"]
        made = w.ok("POST", "/v1/admin/keys", {"user": "alice", "tenant": "acme", "scopes": scopes}, key="admin",
                    status=201)  # fmt: skip
        w.ok("PUT", "/v1/secrets/AGENT_KEY", {"value": "agent-secret"}, status=204)
        yield Fleet(w, ssh_port, made["secret"])


@pytest.fixture(scope="module")
def tab(browser: Any, fleet: Fleet) -> Iterator[Tab]:
    tab = Tab(browser, fleet.url, wait_ms=WAIT_MS)
    tab.sign_in(fleet.dev_key)
    yield tab
    tab.close()


# -- services -------------------------------------------------------------------------------------------------


def test_services_create_scale_roll_out_fail_and_delete(tab: Tab, fleet: Fleet) -> None:
    page = tab.page
    tab.go("#/services")
    page.wait_for_selector("text=No services yet: create one.")
    page.click("button:has-text('Create service')")
    # The server's limits are in the form.
    limits = fleet.api("GET", "/v1/capabilities")["limits"]
    page.wait_for_selector(f"dialog label:has-text('at most {limits['max_cpus']}')")
    page.fill("dialog input[name=name]", "web")
    page.fill("dialog textarea[name=command]", json.dumps(SERVE))
    page.fill("dialog input[name=port]", "8080")
    page.select_option("dialog select[name=health_kind]", "http")
    page.fill("dialog input[name=health_what]", "/")
    page.fill("dialog input[name=every_secs]", "1")
    page.fill("dialog input[name=failures]", "2")
    page.check("dialog input[name=public]")
    tab.shot("service-create")
    page.click("dialog button:has-text('Create')")
    page.wait_for_selector("#ready:has-text('1 / 1 ready')")
    svc = fleet.api("GET", "/v1/services/web")
    assert svc["spec"]["command"] == SERVE and svc["spec"]["health"]["http"] == "/"
    # The address: the path form on this gateway, and the domain form (--services-domain svc.test).
    hrefs = page.eval_on_selector_all("a.address", "links => links.map(a => a.getAttribute('href'))")
    assert hrefs == [f"{fleet.url}/svc/web--acme/", "http://web--acme.svc.test/"], hrefs
    assert fleet.w.traffic("/svc/web--acme/", key=None).status == 200
    tab.shot("service")

    page.click("button:has-text('Scale')")
    page.fill("dialog input[name=replicas]", "2")
    page.click("dialog button:has-text('Scale')")
    page.wait_for_selector("#ready:has-text('2 / 2 ready')")
    assert fleet.api("GET", "/v1/services/web")["desired"] == 2

    # A new revision whose replicas start slowly (8 s before they serve): the page shows the rollout as it goes,
    # without a reload, then done.
    page.click("button:has-text('Roll out a new revision')")
    slow = ["python3", "-c", "import time; time.sleep(8)\n" + SERVER]
    assert json.loads(page.input_value("dialog textarea[name=command]")) == SERVE  # the spec's own, to edit
    page.fill("dialog textarea[name=command]", json.dumps(slow))
    page.fill("dialog input[name=failures]", "30")
    page.fill("dialog textarea[name=env]", "GREETING=hello")
    page.click("dialog button:has-text('Roll out')")
    page.wait_for_selector(".rollout-progress:has-text('Rolling out revision 1 → 2')")
    tab.shot("service-rollout-progress")
    page.wait_for_selector(".rollout-done:has-text('Revision 2 serving')")
    page.wait_for_selector("#ready:has-text('2 / 2 ready')")
    assert fleet.w.traffic("/svc/web--acme/", key=None).body.decode().split()[1] == "hello"

    # A revision that never becomes healthy: its rollout fails, the page says why, revision 2 keeps serving.
    # Its command holds markup: shown as text.
    page.click("button:has-text('Roll out a new revision')")
    page.fill("dialog textarea[name=command]", f"echo '{HOSTILE}'; exit 7")
    page.fill("dialog textarea[name=env]", "GREETING=hello")
    page.click("dialog button:has-text('Roll out')")
    reason = page.wait_for_selector("#rollout-reason")
    assert reason is not None
    failed = fleet.api("GET", "/v1/services/web")
    assert failed["rollout"]["state"] == "failed" and (failed["revision"], failed["serving"]) == (3, 2)
    shown = reason.inner_text()
    assert shown == failed["rollout"]["reason"], (shown, failed["rollout"])
    assert "revision 3 never became healthy" in shown and "exited with code 7" in shown
    page.wait_for_selector(".rollout-failed:has-text('Rollout from revision 2 to 3 failed')")
    page.wait_for_selector("dd code:has-text('exit 7')")
    codes = page.eval_on_selector_all("dd code", "c => c.map(x => x.textContent)")
    assert commandline_text(["sh", "-c", f"echo '{HOSTILE}'; exit 7"]) in codes, codes
    tab.no_markup_ran()
    tab.shot("service-rollout-failed")
    page.wait_for_selector("#ready:has-text('2 / 2 ready')")

    page.click("header nav >> text=Services")
    page.wait_for_selector("td >> text=rollout to 3 failed")
    page.wait_for_selector("td >> text=2 healthy")
    tab.shot("services")
    page.click("td a:text-is('web')")
    page.click("button:has-text('Delete')")
    page.click("dialog button:has-text('Delete')")
    page.wait_for_selector("text=No services yet: create one.")
    assert fleet.w.call("GET", "/v1/services/web").status == 404


def commandline_text(argv: list[str]) -> str:
    """How the console shows a command: the script of ``sh -c SCRIPT``, else the JSON array."""
    return argv[2] if argv[:2] == ["sh", "-c"] and len(argv) == 3 else json.dumps(argv)


@pytest.mark.parametrize("name", ["Web", HOSTILE])
def test_a_bad_or_hostile_service_name_is_refused_in_the_form_as_text(
    tab: Tab, fleet: Fleet, name: str
) -> None:
    """A service name is a DNS label, so markup cannot be one: the gateway's refusal, which quotes the name, is
    shown in the form as text, and nothing is made."""
    page = tab.page
    tab.go("#/services")
    page.click("button:has-text('Create service')")
    page.fill("dialog input[name=name]", name)
    page.fill("dialog textarea[name=command]", "true")
    page.click("dialog button:has-text('Create')")
    error = page.wait_for_selector("dialog .error")
    assert error is not None
    sent = fleet.w.gw.request("POST", "/v1/services", {"name": name, "command": ["sh", "-c", "true"]},
                              key=fleet.dev_key)  # fmt: skip
    assert error.inner_text() == f"400 invalid_request: {sent.error[1]}", (error.inner_text(), sent.error)
    assert "is not a service name" in error.inner_text() and repr(name) in error.inner_text()
    tab.no_markup_ran()
    if name == HOSTILE:
        tab.shot("service-hostile-name")
    page.click("dialog button:has-text('Cancel')")
    assert fleet.api("GET", "/v1/services")["services"] == []


def test_a_hostile_job_name_is_refused_in_the_form_as_text(tab: Tab, fleet: Fleet) -> None:
    page = tab.page
    tab.go("#/jobs")
    before = fleet.api("GET", "/v1/jobs")["jobs"]
    page.click("button:has-text('Run a job')")
    page.fill("dialog textarea[name=command]", "true")
    hostile = '<img src=x onerror="window.__pwned=3">'  # within 63 characters: refused for what it holds
    page.fill("dialog input[name=name]", hostile)
    page.click("dialog button:has-text('Run')")
    error = page.wait_for_selector("dialog .error")
    assert error is not None and error.inner_text().startswith("400 invalid_request: name"), (
        error.inner_text()
    )
    assert hostile in error.inner_text()
    tab.no_markup_ran()
    page.click("dialog button:has-text('Cancel')")
    assert fleet.api("GET", "/v1/jobs")["jobs"] == before


# -- jobs and agent runs ---------------------------------------------------------------------------------------

TICKS = "for i in $(seq 1 20); do echo tick-$i; sleep 1; done"  # 20 s: read while it runs


def test_a_job_from_the_form_its_output_followed_live_and_its_kept_file(tab: Tab, fleet: Fleet) -> None:
    page = tab.page
    tab.go("#/jobs")
    page.wait_for_selector("text=No jobs yet: run one.")
    page.click("button:has-text('Run a job')")
    page.fill("dialog textarea[name=command]",
              f"{TICKS}; echo '{HOSTILE}'; echo \"$GREETING ${{#AGENT_KEY}}\" > /sandbox/home/out.txt")  # fmt: skip
    page.fill("dialog input[name=name]", "ticker")
    page.fill("dialog textarea[name=env]", "GREETING=hi there")
    page.fill("dialog input[name=secrets]", "AGENT_KEY")
    page.fill("dialog input[name=retries]", "1")
    page.fill("dialog input[name=timeout_secs]", "300")
    page.fill("dialog textarea[name=keep]", "/sandbox/home/out.txt")
    tab.shot("job-form")
    page.click("dialog button:has-text('Run')")
    page.wait_for_selector("h1:has-text('ticker')")
    # Live: the first lines show while the job still runs, under the live heading.
    page.wait_for_selector("#job-output:has-text('tick-2')")
    assert "live" in page.inner_text("#output-heading")
    job_id = page.url.rsplit("/", 1)[1]
    assert fleet.api("GET", f"/v1/jobs/{job_id}")["state"] == "running"
    assert "tick-20" not in page.inner_text("#job-output")
    tab.shot("job-live")
    page.wait_for_selector("#job-state:has-text('succeeded')")
    page.wait_for_selector("#output-heading:text-is('Output of attempt 1')")
    out = page.inner_text("#job-output")
    assert "tick-20" in out and HOSTILE in out, out
    tab.no_markup_ran()
    job = fleet.api("GET", f"/v1/jobs/{job_id}")
    assert (
        job["spec"]["retries"] == 1
        and job["spec"]["timeout_secs"] == 300
        and job["env_names"] == ["GREETING"]
    )
    assert job["spec"]["secrets"] == ["AGENT_KEY"] and job["runs"][0]["exit_code"] == 0
    assert isinstance(job["runs"][0]["pid"], int)  # what the page followed
    with page.expect_download() as download:
        page.click("button[aria-label='Download /sandbox/home/out.txt of attempt 1']")
    assert Path(download.value.path()).read_bytes() == b"hi there 12\n"
    assert download.value.suggested_filename == "out.txt"
    tab.shot("job-done")
    page.click("header nav >> text=Jobs")
    page.wait_for_selector("td >> text=1 of 2")
    page.wait_for_selector("td >> text=succeeded")
    tab.shot("jobs")


def test_a_running_job_is_cancelled(tab: Tab, fleet: Fleet) -> None:
    page = tab.page
    tab.go("#/jobs")
    page.click("button:has-text('Run a job')")
    page.fill("dialog textarea[name=command]", "echo started; sleep 600")
    page.fill("dialog input[name=name]", "sleeper")
    page.select_option("dialog select[name=mode]", "none")
    receiver = Receiver()
    page.fill("dialog input[name=notify]", receiver.url)
    page.click("dialog button:has-text('Run')")
    page.wait_for_selector("#job-output:has-text('started')")
    page.click("button:has-text('Cancel')")
    page.click("dialog button:has-text('Cancel job')")
    page.wait_for_selector("#job-state:has-text('cancelled')")
    job_id = page.url.rsplit("/", 1)[1]
    job = fleet.api("GET", f"/v1/jobs/{job_id}")
    assert job["state"] == "cancelled" and job["runs"][0]["state"] == "cancelled"
    sandbox = job["runs"][0]["sandbox"]
    left = fleet.w.gw.request("GET", f"/v1/sandboxes/{sandbox}", key=fleet.dev_key)
    # Ended: listed as terminated, or already forgotten (the fixture's gateway forgets within a second).
    assert left.status == 404 or left.json()["state"] == "terminated", (left.status, left.body)
    assert page.locator("button:has-text('Cancel')").count() == 0
    assert job["spec"]["network"] == {"mode": "none"} and job["spec"]["notify"] == receiver.url
    try:
        told = wait_for(lambda: [b for b in receiver.bodies if b["event"] == "job.finished"], 60, 0.2)
        assert told == [{"event": "job.finished", "job": job_id, "name": "sleeper", "job_state": "cancelled"}]
    finally:
        receiver.close()


def test_an_agent_run_from_the_form(tab: Tab, fleet: Fleet) -> None:
    page = tab.page
    tab.go("#/jobs")
    page.click("button:has-text('Run an agent')")
    page.wait_for_selector("dialog select[name=agent] option", state="attached")
    options = page.eval_on_selector_all("dialog select[name=agent] option", "o => o.map(x => x.value)")
    assert options == ["shouter"]  # the gateway's agents file
    page.wait_for_selector("dialog small:has-text('shouter: secrets AGENT_KEY, timeout 120 s')")
    page.fill("dialog textarea[name=prompt]", "make it loud\nplease")
    page.fill("dialog textarea[name=keep]", "/sandbox/home/result.txt")
    tab.shot("agent-form")
    page.click("dialog button:has-text('Run agent')")
    page.wait_for_selector("text=agent shouter")
    page.wait_for_selector("#job-state:has-text('succeeded')")
    page.wait_for_selector("#job-output:has-text('agent read 19 chars; key present')")
    with page.expect_download() as download:
        page.click("button[aria-label='Download /sandbox/home/result.txt of attempt 1']")
    assert Path(download.value.path()).read_bytes() == b"MAKE IT LOUD\nPLEASE"
    tab.shot("agent-run")


def test_the_agents_are_listed_without_their_environment_values(fleet: Fleet) -> None:
    agents = fleet.api("GET", "/v1/agents")["agents"]
    assert [(a["name"], a["secrets"], a["env_names"], a["timeout_secs"]) for a in agents] == [
        ("shouter", ["AGENT_KEY"], [], 120)
    ]
    assert agents[0]["argv"][-1] == "{prompt_file}"
    with Client(fleet.url, fleet.dev_key) as client:  # the SDK's call
        listed = client.jobs.agents()
    assert [(a.name, a.secrets, a.env_names, a.timeout_secs) for a in listed] == [
        ("shouter", ["AGENT_KEY"], [], 120)
    ]
    reader = fleet.w.call("GET", "/v1/agents", key="reader")
    assert reader.status == 200
    assert fleet.w.call("GET", "/v1/agents", key="").status == 401


# -- secrets --------------------------------------------------------------------------------------------------


def test_a_secret_is_set_write_only_and_never_left_in_the_page(tab: Tab, fleet: Fleet) -> None:
    page = tab.page
    value = f"v4lue-{uuid.uuid4().hex}"
    tab.go("#/secrets")
    page.wait_for_selector("td code:text-is('AGENT_KEY')")
    page.click("button:has-text('New secret')")
    page.fill("#secret-name", "DB_PASSWORD")
    page.fill("#secret-value", value)
    assert page.get_attribute("#secret-value", "type") == "password"
    tab.shot("secret-form")
    page.click("dialog button:has-text('Save')")
    page.wait_for_selector("td code:text-is('DB_PASSWORD')")
    assert_value_gone(tab, value)
    listed = {s["name"] for s in fleet.api("GET", "/v1/secrets")["secrets"]}
    assert listed == {"AGENT_KEY", "DB_PASSWORD"}
    assert stored_digest(fleet, "DB_PASSWORD") == hashlib.sha256(value.encode()).hexdigest()
    tab.shot("secrets")

    # Set again (the name fixed), and a refused value: the error shown, the old value kept, nothing left behind.
    again = f"s3cond-{uuid.uuid4().hex}\n-----END {uuid.uuid4().hex}-----\n"
    page.click("button[aria-label='Set DB_PASSWORD']")
    assert page.get_attribute("#secret-name", "readonly") is not None
    page.fill("#secret-value", "x" * (64 * 1024 + 1))
    page.click("dialog button:has-text('Save')")
    error = page.wait_for_selector("dialog .error")
    assert error is not None and error.inner_text().startswith("400 invalid_request:"), error.inner_text()
    page.check("#secret-multiline")  # several lines: a text area (a password field keeps one line)
    assert page.eval_on_selector("#secret-value", "e => e.tagName") == "TEXTAREA"
    page.fill("#secret-value", again)
    page.click("dialog button:has-text('Save')")
    page.wait_for_selector("dialog", state="detached")
    for line in again.splitlines():
        assert_value_gone(tab, line)
    assert stored_digest(fleet, "DB_PASSWORD") == hashlib.sha256(again.encode()).hexdigest()

    # A bad name is refused with the gateway's message, and makes nothing.
    page.click("button:has-text('New secret')")
    page.fill("#secret-name", "1BAD")
    page.fill("#secret-value", value)
    page.click("dialog button:has-text('Save')")
    error = page.wait_for_selector("dialog .error")
    assert error is not None and "400 invalid_request" in error.inner_text()
    page.click("dialog button:has-text('Cancel')")
    assert_value_gone(tab, value)
    assert {s["name"] for s in fleet.api("GET", "/v1/secrets")["secrets"]} == {"AGENT_KEY", "DB_PASSWORD"}

    page.click("button[aria-label='Delete DB_PASSWORD']")
    page.click("dialog button:has-text('Delete')")
    page.wait_for_selector("td code:text-is('DB_PASSWORD')", state="detached")
    assert {s["name"] for s in fleet.api("GET", "/v1/secrets")["secrets"]} == {"AGENT_KEY"}


def assert_value_gone(tab: Tab, value: str) -> None:
    """The value is in no element, attribute, text, form field or storage of the page."""
    page = tab.page
    assert page.locator("dialog").count() == 0
    assert value not in page.content()
    fields = page.evaluate("[...document.querySelectorAll('input, textarea')].map(e => e.value)")
    assert all(value not in f for f in fields)
    assert value not in page.evaluate("document.body.innerText")
    assert value not in page.evaluate("JSON.stringify(Object.entries(sessionStorage))")


def stored_digest(fleet: Fleet, name: str) -> str:
    """The SHA-256 of the secret as a job's sandbox gets it (the value itself never printed)."""
    job = fleet.api("POST", "/v1/jobs", {"command": ["sh", "-c", f'printf %s "${name}" | sha256sum'],
                                         "secrets": [name]}, status=201)  # fmt: skip
    done = fleet.w.wait_job(job["id"])
    assert done["state"] == "succeeded", done
    return fleet.w.output(job["id"], 1)[0].decode().split()[0]


# -- SSH ------------------------------------------------------------------------------------------------------


def ssh_fingerprint(line: str) -> str:
    digest = hashlib.sha256(base64.b64decode(line.split()[1])).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def test_ssh_host_keys_command_token_and_keys(tab: Tab, fleet: Fleet, tmp_path: Path) -> None:
    page = tab.page
    made = fleet.api("POST", "/v1/sandboxes", {"name": "box"}, status=201)
    info = fleet.api("GET", "/v1/ssh")
    # From the sandbox's own page: its SSH button opens the SSH page with it picked.
    tab.go(f"#/sandboxes/{made['id']}/overview")
    page.click("a.button:text-is('SSH')")
    page.wait_for_selector("code.fingerprint")
    shown = page.eval_on_selector_all("code.fingerprint", "c => c.map(x => x.textContent)")
    assert shown == [ssh_fingerprint(k) for k in info["host_keys"]] and shown[0] == info["fingerprint"]
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(page.input_value("#known-hosts") + "\n")
    page.wait_for_selector(f"#ssh-sandbox option[value='{made['id']}']", state="attached")
    assert page.input_value("#ssh-sandbox") == made["id"]
    command = page.input_value("#ssh-command")
    assert command == f"ssh -p {fleet.ssh_port} box@127.0.0.1", command

    # Register a key whose comment holds markup: listed as text, its fingerprint as ssh-keygen says.
    key = tmp_path / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", HOSTILE, "-f", str(key)], check=True)
    public = key.with_suffix(".pub").read_text().strip()
    printed = subprocess.run(["ssh-keygen", "-l", "-f", str(key.with_suffix(".pub"))], check=True,
                             capture_output=True, text=True).stdout.split()[1]  # fmt: skip
    page.click("button:has-text('Register a key')")
    page.fill("dialog textarea[name=key]", public)
    page.click("dialog button:has-text('Register')")
    page.wait_for_selector(f"td code:text-is('{printed}')")
    assert public in page.eval_on_selector_all("div.key-line", "c => c.map(x => x.textContent)")
    tab.no_markup_ran()
    tab.shot("ssh")

    # The command line shown logs in with plain OpenSSH, checking the host against the page's known_hosts lines.
    opts = ["-o", f"UserKnownHostsFile={known_hosts}", "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes",
            "-o", "IdentitiesOnly=yes", "-i", str(key)]  # fmt: skip
    argv = command.split()
    run = subprocess.run([argv[0], *opts, *argv[1:], "echo", "in-the-box"], check=False, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert (run.returncode, run.stdout) == (0, "in-the-box\n"), run.stderr

    # A token login for this sandbox, shown once.
    page.fill("#ssh-ttl", "600")
    page.click("#make-token")
    token_command = page.input_value("#ssh-token-command")
    assert token_command.startswith(f"ssh -p {fleet.ssh_port} sgt_") and token_command.endswith("@127.0.0.1")
    tab.shot("ssh-token")
    page.click("dialog button:has-text('Done')")
    token = token_command.split()[-1].split("@")[0]
    assert token not in page.content()
    assert all(
        token not in v for v in page.evaluate("[...document.querySelectorAll('input')].map(e => e.value)")
    )
    token_opts = ["-o", f"UserKnownHostsFile={known_hosts}", "-o", "StrictHostKeyChecking=yes",
                  "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes", "-o", "IdentityFile=/dev/null"]  # fmt: skip
    argv = token_command.split()
    run = subprocess.run([argv[0], *token_opts, *argv[1:], "echo", "by-token"], check=False, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert (run.returncode, run.stdout) == (0, "by-token\n"), run.stderr

    key_id = fleet.api("GET", "/v1/ssh-keys")["keys"][0]["id"]
    page.click(f"button[aria-label='Delete key {key_id}']")
    page.click("dialog button:has-text('Delete')")
    page.wait_for_selector("text=No SSH keys registered")
    assert fleet.api("GET", "/v1/ssh-keys")["keys"] == []
    fleet.api("DELETE", f"/v1/sandboxes/{made['id']}", status=204)


def test_a_bad_ssh_key_is_refused_with_the_gateways_message(tab: Tab, fleet: Fleet) -> None:
    page = tab.page
    tab.go("#/ssh")
    page.click("button:has-text('Register a key')")
    page.fill("dialog textarea[name=key]", "ssh-dss AAAAB3NzaC1kc3MAAACBAP")
    page.click("dialog button:has-text('Register')")
    error = page.wait_for_selector("dialog .error")
    assert error is not None
    assert error.inner_text().startswith("400 invalid_request: DSA keys (ssh-dss) are refused"), (
        error.inner_text()
    )
    page.click("dialog button:has-text('Cancel')")
    assert fleet.api("GET", "/v1/ssh-keys")["keys"] == []


# -- live updates of the fleet ----------------------------------------------------------------------------------


def test_a_node_cordoned_elsewhere_and_a_drain_show_without_a_reload(browser: Any, fleet: Fleet) -> None:
    admin = Tab(browser, fleet.url, wait_ms=WAIT_MS)
    page = admin.page
    made = fleet.api("POST", "/v1/sandboxes", {"name": "drained"}, status=201)
    node = made["id"].split("_")[1]  # sbx_<node>_<hex>
    running = f"tr:has(td strong:text-is('{node}')) td[data-label='Running']"
    # The same cell for the page's own script (querySelector knows no :text-is).
    cell = ("n => [...document.querySelectorAll('td strong')].find(e => e.textContent === n)"
            "?.closest('tr').querySelector(\"td[data-label='Running']\")?.textContent")  # fmt: skip

    def api_running() -> int:
        nodes = fleet.w.ok("GET", "/v1/admin/nodes", key="admin")["nodes"]
        return int(next(n for n in nodes if n["name"] == node)["status"]["running"])

    try:
        admin.sign_in(fleet.w.keys["admin"])
        page.click("header nav >> text=Nodes")
        page.wait_for_selector("button[aria-label='Cordon a']")
        fleet.w.ok("POST", "/v1/admin/nodes/a/cordon", {"cordoned": True}, key="admin")
        page.wait_for_selector("button[aria-label='Uncordon a']")
        admin.shot("admin-nodes-live")
        fleet.w.ok("POST", "/v1/admin/nodes/a/cordon", {"cordoned": False}, key="admin")
        page.wait_for_selector("button[aria-label='Cordon a']")

        # Drain the sandbox's node from the page (not terminating): one left running; once it ends elsewhere,
        # the page shows the count going down by itself.
        wait_for(lambda: api_running() >= 1, 30)
        page.wait_for_function(f"n => Number(({cell})(n)) >= 1", arg=node)
        before = int(page.inner_text(running))
        page.click(f"button[aria-label='Drain {node}']")
        page.click("dialog button:has-text('Drain')")
        page.wait_for_selector("p.drain-result:has-text('still running; 0 terminated')")
        assert int(page.inner_text("p.drain-result").split()[0]) >= 1
        admin.shot("admin-drain")
        page.click("dialog button:has-text('Close')")
        page.wait_for_selector(f"button[aria-label='Uncordon {node}']")
        fleet.api("DELETE", f"/v1/sandboxes/{made['id']}", status=204)
        after = wait_for(lambda: (n := api_running()) < before and n + 1, 60) - 1
        page.wait_for_function(f"([n, count]) => ({cell})(n) === String(count)", arg=[node, after])
        admin.shot("admin-drain-done")
    finally:
        fleet.w.ok("POST", f"/v1/admin/nodes/{node}/cordon", {"cordoned": False}, key="admin")
        admin.close()


def test_pages_at_phone_width(browser: Any, fleet: Fleet) -> None:
    phone = Tab(browser, fleet.url, width=390, height=844, wait_ms=WAIT_MS)
    try:
        phone.sign_in(fleet.dev_key)
        for hash_path, shown, name in [
            ("#/services", "text=/ services? · updated/", "phone-services"),
            ("#/jobs", "text=/jobs · updated/", "phone-jobs"),
            ("#/secrets", "td code:text-is('AGENT_KEY')", "phone-secrets"),
            ("#/ssh", "code.fingerprint", "phone-ssh"),
        ]:
            phone.go(hash_path)
            phone.page.wait_for_selector(shown)
            phone.shot(name)
            overflow = phone.page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
            assert overflow <= 0, f"{hash_path} is {overflow}px wider than a phone"
    finally:
        phone.close()
