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
