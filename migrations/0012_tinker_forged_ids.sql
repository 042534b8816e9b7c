-- From this version a Tinker model or sampling session lives in a session of its own organisation, and its id
-- has the shape the server derives (`gateway/tinker/paths.py`). Rows made before then against that rule (in
-- another organisation's session, to take its next ids; under a made-up session id, such as a path) are no
-- client's legitimate work: they are dropped with their requests, checkpoints and served models, so that they
-- hold no organisation's ids and no blob key or host path is ever built from them. Their files stay where they
-- are (a key built from a made-up id may name another organisation's directory: nothing is deleted by it).
DELETE FROM tinker_samplers t
WHERE t.id !~ '^ts-[A-Za-z0-9]{1,64}:sample:(0|[1-9][0-9]{0,9})$'
   OR NOT EXISTS (SELECT 1 FROM tinker_sessions s
                  WHERE s.id = t.session_id AND s.organization_id = t.organization_id);

CREATE TEMPORARY TABLE forged_tinker_models ON COMMIT DROP AS
SELECT m.id FROM tinker_models m
WHERE m.id !~ '^ts-[A-Za-z0-9]{1,64}:train:(0|[1-9][0-9]{0,9})$'
   OR NOT EXISTS (SELECT 1 FROM tinker_sessions s
                  WHERE s.id = m.session_id AND s.organization_id = m.organization_id);

DELETE FROM models WHERE id IN (
    SELECT c.served_model FROM tinker_checkpoints c
    WHERE c.model_id IN (SELECT id FROM forged_tinker_models) AND c.served_model IS NOT NULL);
DELETE FROM tinker_checkpoints WHERE model_id IN (SELECT id FROM forged_tinker_models);
DELETE FROM tinker_requests WHERE model_id IN (SELECT id FROM forged_tinker_models);
DELETE FROM tinker_models WHERE id IN (SELECT id FROM forged_tinker_models);
