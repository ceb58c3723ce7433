// Small improvements only: every page works without this file.
// Memory pages: keyboard shortcuts j / k (next / previous memory) and r (random), outside form fields.
(function () {
  "use strict";
  document.addEventListener("keydown", function (e) {
    var t = e.target;
    if (e.altKey || e.ctrlKey || e.metaKey || (t && (t.isContentEditable || /^(INPUT|TEXTAREA|SELECT|BUTTON)$/.test(t.tagName)))) return;
    var id = { j: "next", k: "prev", r: "random" }[e.key];
    var a = id && document.getElementById(id);
    if (a) { window.location.href = a.href; }
  });
  // The annotation form: saving with a blank name focuses the name field.
  var form = document.getElementById("annotate-form");
  if (form) {
    form.addEventListener("submit", function (e) {
      var name = form.querySelector("input[name=annotator]");
      if (name && !name.value.trim()) { e.preventDefault(); name.focus(); }
    });
  }
})();

// ---- The annotation form: pattern slots and refused forms ----------------------------------------
// "more pattern slots" adds three slots in place (a column of checkboxes in the prefix matrix and
// a fieldset each), keeping what was typed and ticked; without this script the button sends the
// form as typed to the memory page, which shows it again with more slots. After a refused save
// the URL becomes the draft's (a GET), so reloading the page shows the form instead of posting it.
(function () {
  "use strict";
  var form = document.getElementById("annotate-form");
  if (!form) return;
  if (form.dataset.draftUrl && window.history && history.replaceState) {
    history.replaceState(null, "", form.dataset.draftUrl);
  }
  var button = document.getElementById("more-slots");
  var max = parseInt(form.dataset.maxSlots, 10) || 20;
  function count() { return form.querySelectorAll("fieldset.slot").length; }
  function renumber(el, j) {  // slot index j (0-based) into names, labels and legends
    el.querySelectorAll("[name]").forEach(function (x) { x.name = x.name.replace(/^p\d+_/, "p" + j + "_"); });
    el.querySelectorAll("[aria-label]").forEach(function (x) {
      x.setAttribute("aria-label", x.getAttribute("aria-label").replace(/pattern \d+/, "pattern " + (j + 1)));
    });
    var legend = el.querySelector("legend");
    if (legend) legend.textContent = legend.textContent.replace(/\d+/, String(j + 1));
  }
  function addSlot() {
    var j = count();
    var slots = form.querySelectorAll("fieldset.slot");
    var fs = slots[slots.length - 1].cloneNode(true);
    fs.querySelectorAll("input").forEach(function (x) {
      if (x.type === "radio" || x.type === "checkbox") x.checked = false; else x.value = "";
    });
    renumber(fs, j);
    slots[slots.length - 1].parentNode.appendChild(fs);
    var matrix = form.querySelector("table.matrix");
    if (!matrix) return;
    var head = matrix.querySelectorAll("thead th.pcol");
    if (head.length) {
      var th = head[head.length - 1].cloneNode(true);
      th.textContent = th.textContent.replace(/\d+/, String(j + 1));
      head[head.length - 1].parentNode.appendChild(th);
    }
    matrix.querySelectorAll("tbody tr").forEach(function (tr) {
      var cells = tr.querySelectorAll("td.pcol");
      if (!cells.length) return;
      var td = cells[cells.length - 1].cloneNode(true);
      var box = td.querySelector("input");
      if (box) { box.checked = false; box.name = "p" + j + "_prefixes"; }
      renumber(td, j);
      tr.appendChild(td);
    });
  }
  if (button) {
    button.addEventListener("click", function (e) {
      e.preventDefault();
      var first = count();
      for (var k = 0; k < 3 && count() < max; k++) addSlot();
      if (count() >= max) button.hidden = true; else button.value = String(Math.min(count() + 3, max));
      var added = form.querySelectorAll("fieldset.slot")[first];
      var input = added && added.querySelector("input[name$=_description]");
      if (input) input.focus();
    });
  }
})();

// ---- Leaving a page (issue 48): the fetches below that run the model (a page's colours, a memory
// page's later panels) go through ffkvPage.fetch, which aborts them when the page is left (pagehide:
// a link, j / k / r, back), so that none holds the server's model for a page nobody sees (the server
// runs no forward for a request whose client has gone: routers/memory.py). A full page load aborts
// them too; this says so rather than leaving it to the browser, and covers a page kept in the
// back-forward cache, which is reloaded when shown again if a fetch of it was cut.
window.ffkvPage = (function () {
  "use strict";
  var ctl = window.AbortController ? new AbortController() : null;
  var live = 0, cut = false;
  window.addEventListener("pagehide", function () {
    if (ctl && live > 0) { cut = true; ctl.abort(); }
  });
  window.addEventListener("pageshow", function (e) { if (e.persisted && cut) window.location.reload(); });
  return {
    left: function () { return !!(ctl && ctl.signal.aborted); },
    aborted: function (e) { return !!(e && e.name === "AbortError"); },
    fetch: function (url, opts) {
      opts = opts || {};
      if (ctl) opts.signal = ctl.signal;
      live++;
      var done = function () { live--; };
      var p = fetch(url, opts);
      p.then(done, done);
      return p;
    }
  };
})();

// ---- Per-token coefficients (issue 26; ffkv.web.activations) -------------------------------------
// A page with an element [data-act-src] (a memory page, a sentence page opened with ?memory=L/D,
// a search page) fetches that JSON and tints every token `.ex[data-sid] .tk[data-i]` by the
// memory's coefficient m there: classes mp1..mp8 (positive) and mn1..mn8 (negative), each sign
// relative to its own largest |m| shown of that memory (scale_pos, scale_neg; `scale`, the larger,
// where they are absent). One memory's JSON has {scale, scale_pos, scale_neg, examples}; a search
// page's has {memories: {"L/D": {...}}}, and each example names its memory (data-memory).
// The value goes into data-m and the token's title (hover); a focused token shows it (style.css),
// and the arrow keys move between an example's tokens. Without this script the page shows the
// same examples, uncoloured.
(function () {
  "use strict";
  var status = document.querySelector("[data-act-src]");
  if (!status || !window.fetch) return;
  var LEVELS = 8;
  status.hidden = false;
  status.dataset.state = "loading";
  status.textContent = "colouring… (the model computes this memory's m at every token shown)";
  function show(x) {
    var a = Math.abs(x);
    return (a !== 0 && (a < 1e-3 || a >= 1e4)) ? x.toExponential(3) : x.toFixed(4);
  }
  function paint(j) {
    var n = 0, many = !!j.memories;
    document.querySelectorAll(".ex[data-sid]").forEach(function (ex) {
      var g = many ? j.memories[ex.dataset.memory] : j;
      var e = g && g.examples[ex.dataset.sid];
      if (!e) return;
      var sp = g.scale_pos === undefined ? (g.scale || 0) : g.scale_pos;
      var sn = g.scale_neg === undefined ? (g.scale || 0) : g.scale_neg;
      var first = null, anchor = null;
      ex.querySelectorAll(".tk[data-i]").forEach(function (t) {
        var i = parseInt(t.dataset.i, 10), k = i - e.start;
        if (k < 0 || k >= e.m.length || e.m[k] === null) return;
        var m = e.m[k];
        t.dataset.m = String(m);
        var scale = m > 0 ? sp : sn;
        var level = scale > 0 ? Math.min(LEVELS, Math.round(LEVELS * Math.abs(m) / scale)) : 0;
        if (level > 0) t.classList.add((m > 0 ? "mp" : "mn") + level);
        if (t.dataset.title0 === undefined) t.dataset.title0 = t.getAttribute("title") || "";
        t.title = (t.dataset.title0 ? t.dataset.title0 + " · " : "") + "m = " + show(m);
        t.tabIndex = -1;
        if (first === null) first = t;
        if (ex.dataset.pos !== undefined && String(i) === ex.dataset.pos) anchor = t;
        n++;
      });
      if (first) (anchor || first).tabIndex = 0;
      ex.classList.add("coloured");
    });
    status.dataset.state = "done";
    status.textContent = "";
    var what = many ? " example" : " sentence";
    var how = j.computed ? "computed now for " + j.computed + what + (j.computed === 1 ? "" : "s") +
      " in " + j.seconds + " s" : "from the cache";
    var sp = j.scale_pos === undefined ? (j.scale || 0) : j.scale_pos;
    var sn = j.scale_neg === undefined ? (j.scale || 0) : j.scale_neg;
    status.append(many ? "Tokens tinted by m of each row's memory, each sign relative to its largest |m| shown (" + n +
                  " tokens, " + how + "): " : "Tokens tinted by m of memory " + j.layer + "/" + j.dim + " (" + n +
                  " tokens, " + how + "; each sign on its own scale): ");
    [["mp" + LEVELS, many ? "+ largest" : "+" + show(sp)],
     ["mn" + LEVELS, many ? "− largest" : "−" + show(sn)]].forEach(function (p) {
      var s = document.createElement("span");
      s.className = "act-key " + p[0];
      s.textContent = p[1];
      status.append(s, " ");
    });
    status.append("; hover or focus a token for its value, ← → to move.");
  }
  // settled once the colours are painted or have failed: the later panels wait for it (below)
  window.ffkvColours = window.ffkvPage.fetch(status.dataset.actSrc, { headers: { Accept: "application/json" }, credentials: "same-origin" })
    .then(function (r) {
      return r.json().then(function (j) {
        if (!r.ok) throw new Error((j && j.detail) || ("HTTP " + r.status));
        return j;
      });
    })
    .then(paint)
    .catch(function (e) {
      if (window.ffkvPage.aborted(e)) return;  // the page was left
      status.dataset.state = "failed";
      status.textContent = "Colours unavailable: " + e.message;
    });
  document.addEventListener("keydown", function (e) {
    var t = e.target;
    if (!t || !t.classList || !t.classList.contains("tk") || (e.key !== "ArrowLeft" && e.key !== "ArrowRight")) return;
    var ex = t.closest(".ex");
    if (!ex) return;
    var toks = Array.prototype.slice.call(ex.querySelectorAll(".tk[data-m]"));
    var k = toks.indexOf(t) + (e.key === "ArrowRight" ? 1 : -1);
    if (k < 0 || k >= toks.length) return;
    e.preventDefault();
    t.tabIndex = -1;
    toks[k].tabIndex = 0;
    toks[k].focus();
  });
})();

// ---- Later panels (Step.later_panels): a memory page's panels that need a model forward --------
// The page has a placeholder [data-later-src] linking to /memory/L/D/later-panels (a page of its
// own without this script). Once the colours have settled (painted or failed; at once on a page
// without them: the two share the model, one forward at a time, so asking for the panels first
// would hold the colours back), this fetches that page and puts its [data-later-panels] children
// (the steps' sections) in the placeholder's place; on failure the placeholder says why and keeps
// its link. Its data-state: waiting, loading, failed (gone when done). Leaving the page aborts the
// fetch (ffkvPage, above), or keeps it from starting.
(function () {
  "use strict";
  var box = document.querySelector("[data-later-src]");
  if (!box || !window.fetch || !window.DOMParser) return;
  var status = box.querySelector(".later-status") || box;
  var link = status.querySelector("a");
  var what = link ? link.textContent.replace(/^Compute /, "").replace(/…$/, "") : "the panels";
  var line = document.createElement("span");
  line.className = "later-line";
  line.setAttribute("role", "status");
  status.append(" ", line);
  function say(state, text) { box.dataset.state = state; line.textContent = text; }
  say("waiting", "Computing " + what + " once the colours are done…");
  function load() {
    if (window.ffkvPage.left()) return;  // the page was left while its colours were asked for
    say("loading", "Computing " + what + "… (the model runs over this memory's sentences)");
    return window.ffkvPage.fetch(box.dataset.laterSrc, { headers: { Accept: "text/html" }, credentials: "same-origin" })
      .then(function (r) {
        return r.text().then(function (t) {
          var doc = new DOMParser().parseFromString(t, "text/html");
          if (!r.ok) {
            var d = doc.querySelector(".error .detail") || doc.querySelector("h1");
            throw new Error(d ? d.textContent.trim() : "HTTP " + r.status);
          }
          var got = doc.querySelector("[data-later-panels]");
          if (!got) throw new Error("the answer holds no panels");
          return got;
        });
      })
      .then(function (got) {
        var nodes = Array.prototype.slice.call(got.children).map(function (n) { return document.importNode(n, true); });
        var parent = box.parentNode;
        nodes.forEach(function (n) { parent.insertBefore(n, box); });
        parent.removeChild(box);
        nodes.forEach(function (n) { document.dispatchEvent(new CustomEvent("ffkv:inserted", { detail: n })); });
        var h = null;  // a link to an anchor among them (#regime-nn): there now
        try { h = window.location.hash && document.getElementById(decodeURIComponent(window.location.hash.slice(1))); }
        catch (_) { h = null; }
        if (h && nodes.some(function (n) { return n.contains(h); })) h.scrollIntoView();
      })
      .catch(function (e) {
        if (window.ffkvPage.aborted(e)) return;  // the page was left
        say("failed", "Could not compute " + what + ": " + e.message + ". The link tries again, on a page of its own.");
      });
  }
  var colours = window.ffkvColours;
  if (colours && colours.then) colours.then(load, load); else load();
})();

// ---- Keyboard shortcuts overlay (issue 26 item 10): ? shows or hides the list in base.html, Esc
// and a click outside close it. Without this script the footer link opens it through :target.
(function () {
  "use strict";
  var box = document.getElementById("shortcuts");
  if (!box) return;
  document.documentElement.classList.add("js");  // the overlay is this script's, not :target's
  var back = null;
  function open() { back = document.activeElement; box.hidden = false; box.classList.add("open");
                    var c = document.getElementById("shortcuts-close"); if (c) c.focus(); }
  function close() {
    box.hidden = true; box.classList.remove("open");
    if (window.location.hash === "#shortcuts" && window.history && history.replaceState) {
      history.replaceState(null, "", window.location.pathname + window.location.search);
    }
    if (back && back.focus) back.focus();
  }
  document.addEventListener("keydown", function (e) {
    var t = e.target;
    if (e.altKey || e.ctrlKey || e.metaKey || (t && (t.isContentEditable || /^(INPUT|TEXTAREA|SELECT)$/.test(t.tagName)))) return;
    if (e.key === "?") { e.preventDefault(); if (box.hidden) open(); else close(); }
    else if (e.key === "Escape" && !box.hidden) { e.preventDefault(); close(); }
  });
  var link = document.getElementById("shortcuts-link");
  if (link) link.addEventListener("click", function (e) { e.preventDefault(); open(); });
  var closer = document.getElementById("shortcuts-close");
  if (closer) closer.addEventListener("click", function (e) { e.preventDefault(); close(); });
  box.addEventListener("click", function (e) { if (e.target === box) close(); });
  if (window.location.hash === "#shortcuts") open();
})();

// ---- Boxes that scroll sideways (issue 48 item 7): a phone hides the scrollbar, so a table's
// last columns could sit past the edge unseen. Each box that scrolls gets x-more-r (more to the
// right) and x-more-l (more to the left) while it has hidden content there; style.css fades or
// shades that edge. tests/test_web_crawl.py fails on a scrolling box without the mark.
// Content put in the page later (the later panels: an "ffkv:inserted" event) gets its boxes marked too.
(function () {
  "use strict";
  function scrollers(root) {
    var all = Array.prototype.slice.call(root.querySelectorAll("*"));
    if (root.matches && root.matches("main *")) all.unshift(root);
    return all.filter(function (e) {
      return /auto|scroll/.test(getComputedStyle(e).overflowX) && !/^(TEXTAREA|SELECT|INPUT)$/.test(e.tagName);
    });
  }
  var boxes = [];
  var main = document.querySelector("main");
  function mark(e) {
    var more = e.scrollWidth > e.clientWidth + 1;
    e.classList.toggle("x-scroll", more);
    e.classList.toggle("x-more-r", more && e.scrollLeft + e.clientWidth < e.scrollWidth - 1);
    e.classList.toggle("x-more-l", more && e.scrollLeft > 1);
  }
  var ro = window.ResizeObserver &&
    new ResizeObserver(function (entries) { entries.forEach(function (x) { mark(x.target); }); });
  function watch(found) {
    found.forEach(function (e) {
      boxes.push(e);
      mark(e);
      e.addEventListener("scroll", function () { mark(e); }, { passive: true });
      if (ro) { ro.observe(e); if (e.firstElementChild) ro.observe(e.firstElementChild); }
    });
  }
  if (main) watch(scrollers(main));
  window.addEventListener("resize", function () { boxes.forEach(mark); });
  document.addEventListener("ffkv:inserted", function (ev) {
    if (ev.detail && ev.detail.querySelectorAll) watch(scrollers(ev.detail));
  });
})();
