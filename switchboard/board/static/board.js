// Switchboard Board: live counts and copy buttons. Every page works without this script.
(function () {
  "use strict";

  // Copy buttons: shown only when scripts run.
  document.querySelectorAll("button[data-copy]").forEach(function (button) {
    button.hidden = false;
    button.addEventListener("click", function () {
      var source = document.getElementById(button.getAttribute("data-copy"));
      if (!source) return;
      var text = source.value !== undefined ? source.value : source.textContent;
      var done = function () { button.textContent = "Copied"; setTimeout(function () { button.textContent = "Copy"; }, 1500); };
      if (navigator.clipboard && window.isSecureContext) {
        navigator.clipboard.writeText(text).then(done, function () {});
      } else if (source.select) {
        source.select();
        try { document.execCommand("copy"); done(); } catch (e) { /* the text stays selected */ }
      }
    });
  });

  var body = document.body;
  var url = body.getAttribute("data-stream");
  if (!url || !window.EventSource) return;

  // A live region is refreshed only while nobody is typing in it.
  var dirty = false;
  document.addEventListener("input", function (event) {
    if (event.target.closest && event.target.closest("[data-live]")) dirty = true;
  });

  function busy(region) {
    var active = document.activeElement;
    return dirty || (active && region.contains(active) && /^(INPUT|TEXTAREA|SELECT)$/.test(active.tagName));
  }

  function setCounts(counts, total) {
    var all = Object.assign({ total: total }, counts);
    Object.keys(all).forEach(function (name) {
      document.querySelectorAll('[data-count="' + name + '"]').forEach(function (badge) {
        badge.textContent = String(all[name]);
        badge.classList.toggle("hot", all[name] > 0);
      });
    });
  }

  var refreshing = false;
  function refresh(digest) {
    var region = document.querySelector("[data-live]");
    if (!region || refreshing || busy(region)) return;
    refreshing = true;
    fetch(window.location.href, { credentials: "same-origin", headers: { "Accept": "text/html" } })
      .then(function (answer) { return answer.ok ? answer.text() : null; })
      .then(function (html) {
        if (!html || busy(region)) return;
        var page = new DOMParser().parseFromString(html, "text/html");
        var fresh = page.querySelector("[data-live]");
        if (fresh) {
          region.replaceChildren.apply(region, Array.prototype.slice.call(fresh.childNodes));
          body.setAttribute("data-digest", digest);
          body.dispatchEvent(new CustomEvent("board:refreshed"));
        }
      })
      .catch(function () {})
      .then(function () { refreshing = false; });
  }

  // A page being left stays out of the way: the navigation under way may itself end this page's session (behind
  // a sign-in proxy that now names someone else), and the stream's `signed-out` would then cancel it.
  var leaving = false;
  window.addEventListener("beforeunload", function () { leaving = true; });

  var stream = new EventSource(url);
  stream.addEventListener("counts", function (event) {
    var live = JSON.parse(event.data);
    setCounts(live.counts, live.total);
    if (live.digest !== body.getAttribute("data-digest")) refresh(live.digest);
  });
  stream.addEventListener("signed-out", function () {
    stream.close();
    if (!leaving) window.location.assign("/board/login");
  });
})();
