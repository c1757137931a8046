
(function () {
  var urls = JSON.parse(document.getElementById('mc-images').textContent);
  document.querySelectorAll('img[data-im]').forEach(function (el) {
    var u = urls[el.getAttribute('data-im')]; if (u) el.src = u;
  });
  var cards = Array.prototype.slice.call(document.querySelectorAll('.traj'));
  var texts = cards.map(function (c) { return c.textContent.toLowerCase(); });
  var f = {text: document.getElementById('f-text'), stop: document.getElementById('f-stop'),
           acc: document.getElementById('f-acc'), iter: document.getElementById('f-iter')};
  var count = document.getElementById('f-count');
  function apply() {
    var t = f.text.value.trim().toLowerCase(), n = 0;
    cards.forEach(function (c, i) {
      var ok = (!t || texts[i].indexOf(t) >= 0) &&
               (!f.stop.value || c.dataset.stop === f.stop.value) &&
               (!f.acc.value || c.dataset.acc === f.acc.value) &&
               (!f.iter || !f.iter.value || c.dataset.iter === f.iter.value);
      c.hidden = !ok; if (ok) n++;
    });
    count.textContent = n + ' of ' + cards.length + ' shown';
    var p = new URLSearchParams();
    ['text', 'stop', 'acc', 'iter'].forEach(function (k) {
      if (f[k] && f[k].value) p.set(k === 'text' ? 'q' : k, f[k].value);
    });
    try { history.replaceState(null, '', '#' + p.toString()); } catch (e) {}
  }
  var h = new URLSearchParams(location.hash.slice(1));
  ['text', 'stop', 'acc', 'iter'].forEach(function (k) {
    var v = h.get(k === 'text' ? 'q' : k); if (f[k] && v !== null) f[k].value = v;
  });
  ['text', 'stop', 'acc', 'iter'].forEach(function (k) {
    if (f[k]) f[k].addEventListener(k === 'text' ? 'input' : 'change', apply);
  });
  document.getElementById('f-open').onclick = function () {
    cards.forEach(function (c) { if (!c.hidden) c.open = true; });
  };
  document.getElementById('f-close').onclick = function () {
    cards.forEach(function (c) { c.open = false; });
  };
  apply();
  if (h.get('open') === '1') cards.forEach(function (c) { if (!c.hidden) c.open = true; });
})();
