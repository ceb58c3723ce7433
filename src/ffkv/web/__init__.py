"""The memory browser: `ffkv serve RUN` (FastAPI + Jinja2, server-rendered, reads the run only).

`app.create_app(run)` builds the app; `common` holds what every page shares (CSP, templates,
origin checks); `data.Browser` holds the run's tables in memory and answers searches; `routes`
has the pages and the JSON API. The prediction explorer (`explore`) is its own router.
"""
