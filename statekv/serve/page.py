from __future__ import annotations
def mount_page(app, service):
    pass
