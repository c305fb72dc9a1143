// The operator console: a plain client of the public API (no build step, no external assets).
// Every value that came from the service reaches the page through textContent or an attribute, never as
// HTML, so a client_reference holding markup stays text.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);

  // The access token lives in this closure only, never in localStorage/sessionStorage/cookies: storage is
  // readable by any script that ever runs on this origin and outlives the tab, and this token opens the
  // whole tenant (search, enrol, erase) for its lifetime. Memory dies with the tab; the price is signing in
  // again after a reload. The client secret is not kept at all: the form field is cleared after sign-in.
  let session = null; // {clientId, token, expiresAt}

  const LONG_POLL_S = 10; // the service caps Prefer: wait at its own bound
  let galleryCursor = null; // cursor of the page shown
  let nextCursor = null;

  class ApiError extends Error {
    constructor(status, body) {
      super(describeError(status, body));
      this.status = status;
      this.body = body;
    }
  }

  // The API's envelope message, with the per-field problems it names.
  function describeError(status, body) {
    if (!body || typeof body !== "object") return `HTTP ${status}: the service did not answer with JSON.`;
    const message = body.message || `HTTP ${status}`;
    const fields = body.errors && typeof body.errors === "object" ? Object.entries(body.errors) : [];
    if (!fields.length) return message;
    return `${message} (${fields.map(([name, problem]) => `${name}: ${problem}`).join("; ")})`;
  }

  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

  // One request to the API. Returns {status, body}; throws ApiError on an error envelope. 429 and 503 are
  // retried a few times after their Retry-After.
  async function api(path, { method = "GET", body, json, headers = {}, auth = true } = {}) {
    const init = { method, headers: { ...headers }, credentials: "omit", cache: "no-store" };
    if (auth) {
      if (!session) throw new ApiError(401, { message: "Sign in first." });
      init.headers.Authorization = `Bearer ${session.token}`;
    }
    if (json !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(json);
    } else if (body !== undefined) {
      init.body = body; // FormData: the browser writes the multipart boundary
    }
    for (let attempt = 0; ; attempt += 1) {
      const response = await fetch(path, init);
      let payload = null;
      try {
        payload = await response.json();
      } catch (_) {
        payload = null;
      }
      if ((response.status === 429 || response.status === 503) && attempt < 3) {
        const wait = Number(response.headers.get("Retry-After")) || 1;
        if (wait <= 30) {
          await sleep(wait * 1000);
          continue;
        }
      }
      if (response.status === 401 && auth) {
        signOut("Your session has ended: " + describeError(401, payload) + " Sign in again.");
        throw new ApiError(401, payload);
      }
      if (!response.ok || !payload || payload.status !== true) throw new ApiError(response.status, payload);
      return { status: response.status, body: payload };
    }
  }

  function show(element, visible) {
    element.hidden = !visible;
  }

  function setError(element, message) {
    element.textContent = message || "";
    show(element, Boolean(message));
  }

  function el(tag, props = {}, children = []) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props)) {
      if (key === "text") node.textContent = value;
      else if (key === "className") node.className = value;
      else if (key.startsWith("data-")) node.setAttribute(key, value);
      else node[key] = value;
    }
    for (const child of children) node.append(child);
    return node;
  }

  // ---- sign in / out ----

  async function signIn(event) {
    event.preventDefault();
    setError($("sign-in-error"), "");
    const clientId = $("client-id").value.trim();
    const secret = $("client-secret").value;
    $("sign-in").disabled = true;
    try {
      const { body } = await api("/request-access-token", {
        method: "POST",
        json: { client_id: clientId, client_secret: secret },
        auth: false,
      });
      const data = body.result.data;
      session = { clientId, token: data.token, expiresAt: Date.now() + data.expires_in * 1000 };
      $("client-secret").value = "";
      $("session-client").textContent = clientId;
      show($("session"), true);
      show($("sign-in-panel"), false);
      show($("workspace"), true);
      selectTab("analyse");
    } catch (error) {
      setError($("sign-in-error"), error.message);
    } finally {
      $("sign-in").disabled = false;
    }
  }

  function signOut(message) {
    session = null;
    show($("session"), false);
    show($("workspace"), false);
    show($("sign-in-panel"), true);
    setError($("sign-in-error"), message || "");
    $("faces").tBodies[0].replaceChildren();
    $("stats").replaceChildren();
    $("audit").tBodies[0].replaceChildren();
    show($("result"), false);
  }

  // ---- tabs ----

  function selectTab(name) {
    for (const tab of document.querySelectorAll(".tab")) {
      tab.setAttribute("aria-selected", String(tab.dataset.tab === name));
    }
    for (const panel of document.querySelectorAll("[data-panel]")) show(panel, panel.dataset.panel === name);
    if (name === "gallery") loadGallery(null);
    if (name === "webhook") loadWebhook();
  }

  // ---- photo: drop or choose ----

  let chosenFile = null;
  let previewUrl = null;

  function choose(file) {
    if (!file) return;
    chosenFile = file;
    if (previewUrl) URL.revokeObjectURL(previewUrl);
    previewUrl = URL.createObjectURL(file);
    $("preview").src = previewUrl;
    show($("preview"), true);
    $("drop-text").firstChild.textContent = `${file.name} (${Math.ceil(file.size / 1024)} KiB). Drop another, or `;
    $("run").disabled = false;
  }

  function mode() {
    return document.querySelector("input[name=mode]:checked").value;
  }

  function onModeChange() {
    const search = mode() === "face_search";
    show($("search-options"), search);
    show($("age-options"), !search);
  }

  // ---- run a face search or an age estimation ----

  async function run(event) {
    event.preventDefault();
    if (!chosenFile) return;
    setError($("run-error"), "");
    show($("result"), false);
    $("run").disabled = true;
    const form = new FormData();
    form.append("type", mode());
    form.append("file", chosenFile, chosenFile.name);
    let path;
    if (mode() === "face_search") {
      path = "/face-search";
      const reference = $("client-reference").value;
      if (reference) form.append("client_reference", reference);
      form.append("enroll_face", $("enroll").checked ? "1" : "0");
      if ($("allow-override").checked) form.append("allow_override", "1");
    } else {
      path = "/age-estimation";
      form.append("enroll_face", $("age-enroll").checked ? "1" : "0");
      form.append("wait_for_result", "1");
    }
    try {
      $("run-status").textContent = "Uploading…";
      let { status, body } = await api(path, { method: "POST", body: form });
      const referenceId = body.result.data.reference_id;
      $("result-reference").textContent = referenceId;
      // Face search answers with the reference only; an age estimation with its result once final (200).
      if (path === "/face-search" || status === 202) body = await awaitResult(referenceId);
      render(body.result.data);
      $("run-status").textContent = "Done.";
    } catch (error) {
      $("run-status").textContent = "";
      setError($("run-error"), error.message);
    } finally {
      $("run").disabled = false;
    }
  }

  // Long polling: each request is held by the service until the transaction is final or the wait runs out.
  async function awaitResult(referenceId) {
    for (;;) {
      $("run-status").textContent = "Waiting for the result…";
      const { status, body } = await api("/result", {
        method: "POST",
        json: { reference_id: referenceId },
        headers: { Prefer: `wait=${LONG_POLL_S}` },
      });
      if (status === 200) return body;
      $("run-status").textContent = `Transaction ${body.result.data.state}…`;
    }
  }

  function render(data) {
    show($("result"), true);
    const search = data.face_search_response;
    show($("search-result"), Boolean(search));
    show($("age-result"), !search);
    if (search) {
      const outcome = search.result;
      $("result-reference").textContent = data.service_reference_id;
      $("face-found").textContent = outcome.is_face_found ? "A face was found in the photo." : "No face was found in the photo.";
      const rows = outcome.matched_faces.map(([faceId, score, proofUrl, reference]) =>
        el("tr", { className: "match", "data-face-id": faceId }, [
          el("td", {}, [el("img", { src: proofUrl, alt: `proof of ${faceId}`, className: "proof", loading: "eager" })]),
          el("td", { className: "score", text: Number(score).toFixed(3), "data-score": String(score) }),
          el("td", { className: "reference", text: reference }),
          el("td", {}, [el("code", { text: faceId })]),
        ]),
      );
      $("matches").tBodies[0].replaceChildren(...rows);
      show($("matches"), rows.length > 0);
      show($("no-matches"), rows.length === 0);
    } else {
      $("result-reference").textContent = data.reference_id;
      const found = data.age !== null && data.age !== undefined;
      $("age").textContent = found ? String(data.age) : "no face found";
      $("under-18").textContent = found ? String(data.under_18) : "–";
      $("under-21").textContent = found ? String(data.under_21) : "–";
    }
  }

  // ---- gallery ----

  async function loadStats() {
    try {
      const { body } = await api("/gallery/stats");
      const stats = body.result.data;
      const facts = [
        ["Faces", stats.faces],
        ["References", stats.client_references],
        ["Model", stats.model_version],
        ["Oldest", stats.oldest_enrolment || "–"],
        ["Newest", stats.newest_enrolment || "–"],
      ];
      $("stats").replaceChildren(
        ...facts.flatMap(([name, value]) => [el("dt", { text: name }), el("dd", { text: String(value) })]),
      );
    } catch (error) {
      setError($("gallery-error"), error.message);
    }
  }

  async function loadAudit() {
    try {
      const { body } = await api("/gallery/audit?limit=20");
      const entries = body.result.data.entries;
      $("audit").tBodies[0].replaceChildren(
        ...entries.map((entry) =>
          el("tr", { className: "audit-entry" }, [
            el("td", { text: entry.at }),
            el("td", { className: "action", text: entry.action }),
            el("td", { className: "faces", text: String(entry.faces) }),
            el("td", {}, [el("code", { text: entry.actor })]),
            el("td", {}, [el("code", { text: entry.subject })]),
          ]),
        ),
      );
      $("audit-status").textContent = entries.length ? "" : "Nothing deleted or erased yet.";
    } catch (error) {
      setError($("gallery-error"), error.message);
    }
  }

  // ---- webhook: the endpoint and its recent deliveries ----

  async function loadWebhook() {
    setError($("webhook-error"), "");
    try {
      const { body } = await api("/webhook");
      const hook = body.result.data;
      $("webhook-url").textContent = hook.url || "none (nothing is sent)";
      $("webhook-rotated").textContent = hook.secret_rotated_at || "never";
    } catch (error) {
      if (error.status !== 404) {
        setError($("webhook-error"), error.message);
        return;
      }
      $("webhook-url").textContent = "No webhook registered.";
      $("webhook-rotated").textContent = "";
    }
    try {
      const { body } = await api("/webhook/deliveries?limit=50");
      const deliveries = body.result.data.deliveries;
      $("deliveries").tBodies[0].replaceChildren(...deliveries.map(deliveryRow));
      $("webhook-status").textContent = deliveries.length ? "" : "No delivery attempted yet.";
    } catch (error) {
      setError($("webhook-error"), error.message);
    }
  }

  function deliveryRow(delivery) {
    const again = el("button", { type: "button", text: "Redeliver", className: "redeliver" });
    again.addEventListener("click", () => redeliver(delivery.event_id, again));
    const answer = delivery.status_code !== null ? String(delivery.status_code) : delivery.error || "";
    return el("tr", { className: `delivery ${delivery.outcome}` }, [
      el("td", { text: delivery.at }),
      el("td", {}, [el("code", { text: delivery.reference_id })]),
      el("td", { text: String(delivery.attempt) }),
      el("td", { className: "outcome", text: delivery.outcome }),
      el("td", { text: answer }),
      el("td", { text: String(Math.round(delivery.duration_ms)) }),
      el("td", {}, delivery.outcome === "retrying" ? [] : [again]),
    ]);
  }

  async function redeliver(eventId, button) {
    button.disabled = true;
    try {
      const { body } = await api(`/webhook/events/${encodeURIComponent(eventId)}/redeliver`, { method: "POST" });
      $("webhook-status").textContent = body.result.data.queued ? "Queued again." : "Already queued.";
    } catch (error) {
      setError($("webhook-error"), error.message);
    } finally {
      button.disabled = false;
    }
  }

  async function loadGallery(cursor) {
    setError($("gallery-error"), "");
    $("gallery-status").textContent = "Loading…";
    loadStats();
    loadAudit();
    const params = new URLSearchParams({ limit: $("page-size").value });
    const reference = $("filter-reference").value;
    if (reference) params.set("client_reference", reference);
    if (cursor) params.set("cursor", cursor);
    try {
      const { body } = await api(`/gallery/faces?${params}`);
      const data = body.result.data;
      galleryCursor = cursor;
      nextCursor = data.next_cursor;
      $("faces").tBodies[0].replaceChildren(...data.faces.map(faceRow));
      $("gallery-status").textContent = data.faces.length
        ? `${data.faces.length} face${data.faces.length === 1 ? "" : "s"} on this page${nextCursor ? "; more on the next" : ""}.`
        : "No enrolled faces" + (reference ? " under this client_reference." : ".");
    } catch (error) {
      $("gallery-status").textContent = "";
      setError($("gallery-error"), error.message);
    }
    $("first-page").disabled = !galleryCursor;
    $("next-page").disabled = !nextCursor;
  }

  function faceRow(face) {
    const remove = el("button", { type: "button", className: "delete", text: "Delete" });
    remove.addEventListener("click", () => deleteFace(face.face_id, remove));
    return el("tr", { className: "face", "data-face-id": face.face_id }, [
      el("td", {}, [el("img", { src: face.proof_url, alt: `proof of ${face.face_id}`, className: "proof" })]),
      el("td", { className: "reference", text: face.client_reference }),
      el("td", { text: face.enrolled_at }),
      el("td", { text: face.model_version }),
      el("td", {}, [el("code", { text: face.face_id })]),
      el("td", {}, [remove]),
    ]);
  }

  // Two clicks: the first arms the button, the second deletes.
  async function deleteFace(faceId, button) {
    if (button.dataset.armed !== "1") {
      button.dataset.armed = "1";
      button.textContent = "Confirm delete";
      button.className = "delete danger";
      return;
    }
    button.disabled = true;
    try {
      await api(`/gallery/faces/${encodeURIComponent(faceId)}`, { method: "DELETE" });
      await loadGallery(galleryCursor);
      $("gallery-status").textContent = `Deleted face ${faceId}. ` + $("gallery-status").textContent;
    } catch (error) {
      setError($("gallery-error"), error.message);
      button.disabled = false;
    }
  }

  function askErase(event) {
    event.preventDefault();
    $("erase-status").textContent = "";
    $("erase-target").textContent = $("erase-reference").value;
    show($("erase-confirm"), true);
  }

  async function erase() {
    const reference = $("erase-target").textContent;
    show($("erase-confirm"), false);
    $("erase-status").textContent = "Erasing…";
    try {
      const { body } = await api("/gallery/erasures", { method: "POST", json: { client_reference: reference } });
      const data = body.result.data;
      $("erase-status").textContent =
        `Erased ${data.faces_erased} face${data.faces_erased === 1 ? "" : "s"} of ${data.client_reference} at ${data.erased_at}.`;
      $("erase-reference").value = "";
      await loadGallery(null);
    } catch (error) {
      $("erase-status").textContent = "";
      setError($("gallery-error"), error.message);
    }
  }

  // ---- wiring ----

  function wire() {
    $("sign-in-form").addEventListener("submit", signIn);
    $("sign-out").addEventListener("click", () => signOut(""));
    for (const tab of document.querySelectorAll(".tab")) {
      tab.addEventListener("click", () => selectTab(tab.dataset.tab));
    }
    for (const radio of document.querySelectorAll("input[name=mode]")) radio.addEventListener("change", onModeChange);
    $("photo").addEventListener("change", () => choose($("photo").files[0]));
    const zone = $("drop-zone");
    zone.addEventListener("dragover", (event) => {
      event.preventDefault();
      zone.classList.add("over");
    });
    zone.addEventListener("dragleave", () => zone.classList.remove("over"));
    zone.addEventListener("drop", (event) => {
      event.preventDefault();
      zone.classList.remove("over");
      if (event.dataTransfer && event.dataTransfer.files.length) choose(event.dataTransfer.files[0]);
    });
    $("analyse-form").addEventListener("submit", run);
    $("gallery-filter").addEventListener("submit", (event) => {
      event.preventDefault();
      loadGallery(null);
    });
    $("first-page").addEventListener("click", () => loadGallery(null));
    $("next-page").addEventListener("click", () => loadGallery(nextCursor));
    $("erase-form").addEventListener("submit", askErase);
    $("erase-yes").addEventListener("click", erase);
    $("erase-no").addEventListener("click", () => show($("erase-confirm"), false));
    $("webhook-refresh").addEventListener("click", loadWebhook);
    onModeChange();
  }

  wire();
})();
