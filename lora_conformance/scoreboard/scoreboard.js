// Filters for the scoreboard matrix: engine, device and dtype choose the columns, status keeps the
// features (rows) where a shown column has that status. The query string holds the choice, so a
// filtered view can be linked; the view links (all / aligned) carry it along.
"use strict";
(function () {
  const form = document.getElementById("filters");
  const table = document.getElementById("board");
  if (!form || !table) {
    return;
  }
  const selects = Array.from(form.querySelectorAll("select"));
  const heads = Array.from(table.tHead.rows[0].cells).slice(1);
  const columnKeys = ["engine", "device", "dtype"];
  const params = new URLSearchParams(window.location.search);

  function wanted() {
    const want = {};
    for (const select of selects) {
      if (select.value) {
        want[select.name] = select.value;
      }
    }
    return want;
  }

  function apply() {
    const want = wanted();
    const shown = heads.map((th) => columnKeys.every((k) => !want[k] || th.dataset[k] === want[k]));
    let rowsShown = 0;
    for (const row of Array.from(table.rows)) {
      let match = false;
      Array.from(row.cells).slice(1).forEach((cell, i) => {
        cell.hidden = !shown[i];
        if (shown[i] && cell.dataset.status === want.status) {
          match = true;
        }
      });
      if (row.parentNode.tagName === "TBODY") {
        row.hidden = Boolean(want.status) && !match;
        rowsShown += row.hidden ? 0 : 1;
      }
    }
    const query = new URLSearchParams(want).toString();
    document.getElementById("shown").textContent =
      `${shown.filter(Boolean).length} of ${heads.length} columns, ${rowsShown} features`;
    for (const id of ["view-all", "view-aligned"]) {
      const link = document.getElementById(id);
      if (link) {
        link.search = query ? `?${query}` : "";
      }
    }
    try {
      window.history.replaceState(null, "", query ? `?${query}` : window.location.pathname);
    } catch (e) {
      // Some browsers refuse history changes for pages opened from disk; the filter still applies.
    }
  }

  for (const select of selects) {
    const value = params.get(select.name);
    if (value && Array.from(select.options).some((o) => o.value === value)) {
      select.value = value;
    }
    select.addEventListener("change", apply);
  }
  apply();
})();
