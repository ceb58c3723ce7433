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
