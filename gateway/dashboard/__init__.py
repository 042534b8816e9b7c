"""The browser dashboard served at `/dashboard`: pages rendered on the server (Jinja2), one small script per
page calling the public API through `/dashboard/api/v1/...` (`proxy`) with the session's key (`sessions`),
and uPlot (vendored under `static/vendor/`) for the curves. Nothing to build and no CDN: see
docs/dashboard.md."""
