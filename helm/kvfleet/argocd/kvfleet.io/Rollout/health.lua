-- kvfleet.io/Rollout, the standing rollout policy of one pool. A rollout under way (shadow
-- phase, canary steps) is Progressing; a person's pause, or a pause while
-- Prometheus cannot answer (weight held, resumes by itself), is Suspended; a rollback, an abort
-- or a pause that needs a person (too few samples, inconclusive analysis) is Degraded with the
-- rollout's own message, e.g. "step 1/2 weight 50%: tpot canary/stable 9.4 > 3"; Idle and
-- Promoted are Healthy. The Degraded condition the operator writes decides which pauses need a
-- person. Argo CD runs this in gopher-lua with only the base, table and os libraries.
local hs = {}
local status = obj.status
if status == nil or status.observedGeneration == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the kvfleet operator to observe the rollout"
  return hs
end
if obj.metadata.generation ~= nil and status.observedGeneration < obj.metadata.generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the kvfleet operator to observe generation " ..
    tostring(obj.metadata.generation)
  return hs
end
local degraded = nil
if status.conditions ~= nil then
  for _, condition in ipairs(status.conditions) do
    if condition.type == "Degraded" then
      degraded = condition
    end
  end
end
local phase = status.phase
local message = status.message
if message == nil or message == "" then
  message = tostring(phase)
end
if phase == "RolledBack" or phase == "Aborted" or
    (degraded ~= nil and degraded.status == "True") then
  hs.status = "Degraded"
elseif phase == "Paused" then
  hs.status = "Suspended"
elseif phase == "Shadow" or phase == "Progressing" or phase == "RollingBack" then
  hs.status = "Progressing"
elseif phase == "Idle" or phase == "Promoted" then
  hs.status = "Healthy"
else
  hs.status = "Progressing"
end
hs.message = message
return hs
