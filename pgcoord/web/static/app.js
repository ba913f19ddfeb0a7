// pgcoord dashboard: live updates over server-sent events, and ages that tick.
// The pages work without this file; it only keeps an open page current.
(function () {
  "use strict";
  var body = document.body;
  var version = body.dataset.version;
  var live = document.getElementById("live");
  var busy = false, again = false;

  function say(text, cls) { if (live) { live.textContent = text; live.className = "live " + cls; } }

  function refresh() {
    if (busy) { again = true; return; }
    busy = true;
    fetch(location.href, { headers: { "X-Pgcoord-Fragment": "1" }, credentials: "same-origin" })
      .then(function (r) {
        if (!r.ok) { throw new Error(r.status); }
        version = r.headers.get("X-Pgcoord-Version") || version;
        return r.text();
      })
      .then(function (html) { document.querySelector("main").innerHTML = html; say("live", "on"); })
      .catch(function () { say("stale", "off"); })
      .then(function () { busy = false; if (again) { again = false; refresh(); } });
  }

  if (window.EventSource && version) {  // an error page has no version: nothing to follow
    var events = new EventSource(body.dataset.base + "/events");
    events.addEventListener("version", function (e) { if (e.data !== version) { refresh(); } });
    events.onopen = function () { say("live", "on"); };
    events.onerror = function () { say("reconnecting", "off"); };
  }

  // "Sampled at" shows how old the page's data is, second by second.
  setInterval(function () {
    var t = document.querySelector("p.sampled time[data-at]");
    if (!t) { return; }
    var seconds = Math.max(0, (Date.now() - Date.parse(t.dataset.at)) / 1000);
    t.title = seconds < 90 ? Math.round(seconds) + " s ago" : "";
  }, 1000);
})();
