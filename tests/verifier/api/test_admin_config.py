"""The admin routes' start-up rules (VerifierConfig): either route needs --admin-key, which must differ
from --api-key; --weights-dir must be a directory; open mode with an admin route warns."""

import pytest

from verifier.api.admin import AdminAccess
from verifier.config import VerifierConfig


def test_admin_routes_need_their_own_key(tmp_path):
    for flag in ("allow_weight_updates", "allow_policy_version"):
        with pytest.raises(ValueError, match=f"{flag}: needs --admin-key"):
            VerifierConfig(**{flag: True})
        assert VerifierConfig(**{flag: True}, admin_key="adm").admin_key == "adm"
    with pytest.raises(ValueError, match="admin_key: must differ from --api-key"):
        VerifierConfig(api_key="same", admin_key="same", allow_weight_updates=True)
    with pytest.raises(ValueError, match="weights_dir"):
        VerifierConfig(weights_dir=str(tmp_path / "missing"))
    assert VerifierConfig(weights_dir=str(tmp_path)).weights_dir == str(tmp_path)
    cfg = VerifierConfig(admin_key="secret-admin", api_key="secret-api")
    assert "secret-admin" not in repr(cfg) and "secret-api" not in repr(cfg)
    assert "secret" not in repr(AdminAccess("secret-admin", True))


def test_open_mode_with_admin_routes_warns(monkeypatch):
    assert VerifierConfig(allow_weight_updates=True, admin_key="a").startup_warnings() == []  # loopback
    monkeypatch.setenv("NGRAM_VERIFIER_ALLOW_OPEN", "1")
    assert VerifierConfig(host="0.0.0.0").startup_warnings() == []  # open, but nothing of the admin's
    both = VerifierConfig(host="0.0.0.0", allow_weight_updates=True, allow_policy_version=True,
                          admin_key="a").startup_warnings()
    assert len(both) == 1 and "open to anyone" in both[0]
    assert "weight updates and policy-version announcements" in both[0]
    one = VerifierConfig(host="0.0.0.0", allow_weight_updates=True, admin_key="a").startup_warnings()
    assert len(one) == 1 and "accepts weight updates:" in one[0]
    assert VerifierConfig(host="0.0.0.0", api_key="k", allow_weight_updates=True, admin_key="a").startup_warnings() == []
