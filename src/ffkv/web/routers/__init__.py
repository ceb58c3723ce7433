"""The browser's routes by feature, one router a module; `ffkv.web.routes` includes them all."""
