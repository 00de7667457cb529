/* The step buffer's row of a hooked tensor that joins a Triton batch, without the interpreter.

   StepBuffer.add -> TritonReducer.row -> TritonReducer._defer runs for every activation, activation gradient
   and (undistributed) gradient a hook sees: ~14k machine instructions a row in Python, most of it bytecode.
   FastRows.add does the same for the usual case in C and returns True; whenever anything is unusual (a row
   description not seen before, a tensor that is not contiguous, the learning step, a tensor read at its
   hook, a full store, capture or held tensors, the kernels off) it changes nothing and returns False, and
   the Python path runs. The Python path stays the reference: tests run both and compare.

   Plain CPython API, no torch headers (a tensor's attributes are read through torch.Tensor's own
   descriptors), so one build runs with any torch. State lives in the Python objects (read through their
   __dict__ at every call), so the Python code sees every change this makes and nothing here goes stale. A row
   is read whole before anything is written (read_row, then write_row), so a failed read changes nothing. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

typedef struct {
    PyObject_HEAD
    PyObject *buffer;     /* StepBuffer.__dict__ */
    PyObject *store;      /* _DeviceStore.__dict__ */
    PyObject *reducer;    /* TritonReducer.__dict__ */
    PyObject *flush;      /* TritonReducer._flush, bound */
    PyObject *module;     /* trainmon.stats.triton_path.__dict__ */
    PyObject *codes;      /* dtype -> (stats_batch tag, itemsize) */
    PyObject *strided;    /* torch.strided */
    PyObject *no_collectives;
    PyObject *batch;      /* the _Batch */
    PyObject *tensors, *rows, *versions, *addresses, *numels, *sites, *tags, *by_address;
    PyObject *shared_from, *shared_rows;
    long device_index;    /* -1: the CPU (Triton's interpreter) */
    PyTypeObject *tensor_type;  /* torch.Tensor: other types (subclasses) take the Python path */
    PyObject *descr[9];   /* torch.Tensor's descriptors of what a row reads (enum below) */
} FastRows;

/* the tensor attributes a row reads, called through torch.Tensor's own descriptors: the same getters and
   methods as `tensor.<name>`, without looking the name up on every call */
enum { IS_CPU, IS_CUDA, GET_DEVICE, DTYPE, LAYOUT, IS_CONTIGUOUS, SHAPE, DATA_PTR, VERSION, N_DESCR };
static const char *descr_names[N_DESCR] = {"is_cpu", "is_cuda", "get_device", "dtype", "layout",
                                           "is_contiguous", "shape", "data_ptr", "_version"};

static PyObject *s_rows, *s_placement, *s_collectives, *s_rows_seen, *s_shareable, *s_count_collectives,
    *s_capture, *s_hold, *s_eps, *s_count, *s_capacity, *s_index, *s_data, *s_learnt, *s_at_hook,
    *s_batch_bytes, *s_reducer_eps, *s_unavailable, *s_batch_tensors, *s_nbytes;

static int intern_all(void) {
#define INTERN(var, text) if (!(var = PyUnicode_InternFromString(text))) return -1
    INTERN(s_rows, "rows"); INTERN(s_placement, "_placement"); INTERN(s_collectives, "_collectives");
    INTERN(s_rows_seen, "_rows_seen"); INTERN(s_shareable, "_shareable");
    INTERN(s_count_collectives, "count_collectives"); INTERN(s_capture, "capture"); INTERN(s_hold, "hold");
    INTERN(s_eps, "eps"); INTERN(s_count, "count"); INTERN(s_capacity, "capacity"); INTERN(s_index, "index");
    INTERN(s_data, "data"); INTERN(s_learnt, "_learnt"); INTERN(s_at_hook, "_at_hook");
    INTERN(s_batch_bytes, "_batch_bytes"); INTERN(s_reducer_eps, "_eps"); INTERN(s_unavailable, "_unavailable");
    INTERN(s_batch_tensors, "BATCH_TENSORS"); INTERN(s_nbytes, "nbytes");
#undef INTERN
    return 0;
}

/* a value of a state dict (borrowed), or NULL with an error set when the key is missing */
static PyObject *field(PyObject *dict, PyObject *key) {
    PyObject *value = PyDict_GetItemWithError(dict, key);
    if (!value && !PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
    return value;
}

static PyObject *attr(FastRows *self, int which, PyObject *tensor) {
    PyObject *d = self->descr[which];
    if (Py_IS_TYPE(d, &PyGetSetDescr_Type)) return Py_TYPE(d)->tp_descr_get(d, tensor, (PyObject *)Py_TYPE(tensor));
    PyObject *args[1] = {tensor};
    return PyObject_Vectorcall(d, args, 1, NULL);
}

/* an int attribute or method result of a tensor; -1 with an error set on failure */
static long long int_of(PyObject *value) {
    if (!value) return -1;
    long long result = PyLong_AsLongLong(value);
    Py_DECREF(value);
    return result;
}

/* an item of a batch column; NULL (no error) where the column is shorter than `j` */
static PyObject *item(PyObject *list, Py_ssize_t j) {
    return j >= 0 && j < PyList_GET_SIZE(list) ? PyList_GET_ITEM(list, j) : NULL;
}

/* TritonReducer._Batch.find: whether entry j holds, unchanged since its hook, the elements of a tensor of
   `numel` elements, `dtype` and `version`: 1 yes, 0 no, -1 error */
static int find_shared(FastRows *self, Py_ssize_t j, PyObject *dtype, long long numel, long long version) {
    PyObject *row_of = item(self->rows, j), *held = item(self->tensors, j), *numel_of = item(self->numels, j);
    PyObject *version_of = item(self->versions, j), *address_of = item(self->addresses, j);
    if (!row_of || !held || !numel_of || !version_of || !address_of) return 0;  /* columns out of step */
    long long row = PyLong_AsLongLong(row_of);
    if (row == -1 && PyErr_Occurred()) return -1;
    if (row < 0) return 0;
    Py_INCREF(held);  /* the getters below may run Python (a __torch_function__ mode) */
    int found = 0;
    PyObject *held_dtype = attr(self, DTYPE, held);
    if (!held_dtype) goto error;
    Py_DECREF(held_dtype);
    if (held_dtype != dtype || PyLong_AsLongLong(numel_of) != numel) goto done;  /* dtypes are singletons */
    long long held_version = int_of(attr(self, VERSION, held));
    if (held_version == -1 && PyErr_Occurred()) goto error;
    if (held_version != PyLong_AsLongLong(version_of)) goto done;
    long long held_address = int_of(attr(self, DATA_PTR, held));
    if (held_address == -1 && PyErr_Occurred()) goto error;
    if (held_address != PyLong_AsLongLong(address_of)) goto done;
    found = version == held_version;
done:
    Py_DECREF(held);
    return PyErr_Occurred() ? -1 : found;
error:
    Py_DECREF(held);
    return -1;
}

static int append_new(PyObject *list, PyObject *value) {
    if (!value) return -1;
    int failed = PyList_Append(list, value);
    Py_DECREF(value);
    return failed;
}

/* Everything a row reads, gathered before it writes anything (so a failure, or a Python getter that runs
   other code, leaves no half-written row). Owned references. */
typedef struct {
    PyObject *meta;        /* the row's description (a Row) */
    PyObject *dtype;
    PyObject *address;     /* data_ptr(), the batch's key */
    PyObject *shared;      /* the entry it shares (an int), or NULL */
    int known_address;     /* the batch holds an entry at this address already (shared or not) */
    PyObject *index;       /* its row: the store's count */
    PyObject *collectives; /* the collectives counted so far */
    PyObject *rows, *collective_counts, *placement, *store_index, *eps;
    long tag, itemsize;
    long long numel, version, limit, bound;
} RowParts;

static void release(RowParts *r) {
    Py_CLEAR(r->meta); Py_CLEAR(r->dtype); Py_CLEAR(r->address); Py_CLEAR(r->shared); Py_CLEAR(r->index);
    Py_CLEAR(r->collectives); Py_CLEAR(r->rows); Py_CLEAR(r->collective_counts); Py_CLEAR(r->placement);
    Py_CLEAR(r->store_index); Py_CLEAR(r->eps);
}

/* an owned reference to a state dict's value, or NULL with an error set */
static PyObject *owned(PyObject *dict, PyObject *key) {
    PyObject *value = field(dict, key);
    Py_XINCREF(value);
    return value;
}

/* The reads: 1 the fast path applies (`r` filled), 0 it does not (the Python path runs), -1 error. */
static int read_row(FastRows *self, PyObject *const *args, RowParts *r) {
    PyObject *kind = args[0], *tensor = args[5];
    PyObject *value;
    if (!(value = field(self->buffer, s_capture))) return -1;
    if (value != Py_None) return 0;
    if (!(value = field(self->buffer, s_hold))) return -1;
    if (value != Py_None) return 0;
    if (!(value = field(self->module, s_unavailable))) return -1;
    if (value != Py_None) return 0;
    if (!(value = field(self->reducer, s_learnt))) return -1;
    if (value != Py_True) return 0;
    if (!(value = field(self->buffer, s_shareable))) return -1;
    int shareable = PySet_Contains(value, kind);
    if (shareable <= 0) return shareable;

    if (Py_TYPE(tensor) != self->tensor_type) return 0;
    if (self->device_index < 0) {
        if (!(value = attr(self, IS_CPU, tensor))) return -1;
        Py_DECREF(value);
        if (value != Py_True) return 0;
    } else {
        if (!(value = attr(self, IS_CUDA, tensor))) return -1;
        Py_DECREF(value);
        if (value != Py_True) return 0;
        long long index = int_of(attr(self, GET_DEVICE, tensor));
        if (index == -1 && PyErr_Occurred()) return -1;
        if (index != self->device_index) return 0;
    }
    if (!(value = attr(self, LAYOUT, tensor))) return -1;
    Py_DECREF(value);
    if (value != self->strided) return 0;
    if (!(r->dtype = attr(self, DTYPE, tensor))) return -1;
    PyObject *code = PyDict_GetItemWithError(self->codes, r->dtype);
    if (!code) return PyErr_Occurred() ? -1 : 0;
    if (!PyTuple_Check(code) || PyTuple_GET_SIZE(code) != 2) return 0;
    r->tag = PyLong_AsLong(PyTuple_GET_ITEM(code, 0));
    r->itemsize = PyLong_AsLong(PyTuple_GET_ITEM(code, 1));
    if (PyErr_Occurred()) return -1;
    if (!(value = attr(self, IS_CONTIGUOUS, tensor))) return -1;
    Py_DECREF(value);
    if (value != Py_True) return 0;  /* the Python path copies it, while it holds what the hook saw */

    PyObject *shape = attr(self, SHAPE, tensor);
    if (!shape) return -1;
    if (!PyTuple_Check(shape)) { Py_DECREF(shape); return 0; }
    long long n = 1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(shape); i++) {
        long long size = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
        if (size == -1 && PyErr_Occurred()) { Py_DECREF(shape); return -1; }
        n *= size;
    }
    if (n <= 0) { Py_DECREF(shape); return 0; }
    r->numel = n;

    /* the row's description, as StepBuffer._row looks it up (a plain tuple hashes and compares as a Row) */
    PyObject *fields = PyTuple_New(7);
    if (!fields) { Py_DECREF(shape); return -1; }
    for (int i = 0; i < 5; i++) {
        Py_INCREF(args[i]);
        PyTuple_SET_ITEM(fields, i, args[i]);
    }
    PyTuple_SET_ITEM(fields, 5, shape);  /* the tuple takes the reference */
    Py_INCREF(r->dtype);
    PyTuple_SET_ITEM(fields, 6, r->dtype);
    PyObject *rows_seen = field(self->buffer, s_rows_seen);
    PyObject *meta = rows_seen ? PyDict_GetItemWithError(rows_seen, fields) : NULL;
    Py_DECREF(fields);
    if (!meta) return PyErr_Occurred() ? -1 : 0;  /* first seen: the Python path makes the Row */
    Py_INCREF(meta);
    r->meta = meta;
    PyObject *at_hook = field(self->reducer, s_at_hook);
    if (!at_hook) return -1;
    if (PySet_GET_SIZE(at_hook)) {
        int read_at_hook = PySet_Contains(at_hook, meta);
        if (read_at_hook) return read_at_hook < 0 ? -1 : 0;
    }

    PyObject *count = field(self->store, s_count), *capacity = field(self->store, s_capacity);
    if (!count || !capacity) return -1;
    int full = PyObject_RichCompareBool(count, capacity, Py_GE);
    if (full) return full < 0 ? -1 : 0;  /* the Python path grows the store */
    Py_INCREF(count);
    r->index = count;

    long long address = int_of(attr(self, DATA_PTR, tensor));
    if (address == -1 && PyErr_Occurred()) return -1;
    r->version = int_of(attr(self, VERSION, tensor));
    if (r->version == -1 && PyErr_Occurred()) return -1;
    if (!(r->address = PyLong_FromLongLong(address))) return -1;
    PyObject *first = PyDict_GetItemWithError(self->by_address, r->address);
    if (first) {
        r->known_address = 1;
        Py_INCREF(first);
        Py_ssize_t j = PyLong_AsSsize_t(first);
        int shared = j == -1 && PyErr_Occurred() ? -1 : find_shared(self, j, r->dtype, r->numel, r->version);
        if (shared > 0) r->shared = first;
        else Py_DECREF(first);
        if (shared < 0) return -1;
    } else if (PyErr_Occurred()) {
        return -1;
    }

    PyObject *counter = field(self->buffer, s_count_collectives);
    if (!counter) return -1;
    r->collectives = counter == self->no_collectives ? PyLong_FromLong(0) : PyObject_CallNoArgs(counter);
    if (!r->collectives) return -1;
    if (!(r->rows = owned(self->buffer, s_rows)) || !(r->collective_counts = owned(self->buffer, s_collectives))
        || !(r->placement = owned(self->buffer, s_placement)) || !(r->store_index = owned(self->store, s_index))
        || !(r->eps = owned(self->buffer, s_eps)))
        return -1;
    if (!PyList_Check(r->rows) || !PyList_Check(r->collective_counts) || !PyList_Check(r->placement)) return 0;
    PyObject *limit = field(self->module, s_batch_tensors), *bound = field(self->reducer, s_batch_bytes);
    if (!limit || !bound) return -1;
    r->limit = PyLong_AsLongLong(limit);
    r->bound = PyLong_AsLongLong(bound);
    return PyErr_Occurred() ? -1 : 1;
}

/* The writes, as StepBuffer.add and TritonReducer._defer make them: only appends and stores, which fail
   only for want of memory. Returns 1 when the batch is full (to be launched), 0 not, -1 error. */
static int write_row(FastRows *self, PyObject *tensor, RowParts *r) {
    long long index = PyLong_AsLongLong(r->index);
    if (index == -1 && PyErr_Occurred()) return -1;
    PyObject *next = PyLong_FromLongLong(index + 1);
    if (!next) return -1;
    int failed = PyDict_SetItem(self->store, s_count, next);
    Py_DECREF(next);
    if (failed) return -1;
    int full = 0;
    if (r->shared) {  /* the same tensor again (a module's input: the previous module's output): read once */
        if (PyList_Append(self->shared_from, r->shared) || PyList_Append(self->shared_rows, r->index)) goto error;
    } else {
        if (!r->known_address) {
            PyObject *position = PyLong_FromSsize_t(PyList_GET_SIZE(self->tensors));
            failed = !position || PyDict_SetItem(self->by_address, r->address, position);
            Py_XDECREF(position);
            if (failed) goto error;
        }
        if (PyList_Append(self->tensors, tensor) || PyList_Append(self->rows, r->index)
            || append_new(self->versions, PyLong_FromLongLong(r->version))
            || PyList_Append(self->addresses, r->address)
            || append_new(self->numels, PyLong_FromLongLong(r->numel)) || PyList_Append(self->sites, r->meta)
            || append_new(self->tags, PyLong_FromLong(r->tag)))
            goto error;
        long long nbytes = int_of(PyObject_GetAttr(self->batch, s_nbytes));
        if (nbytes == -1 && PyErr_Occurred()) goto error;
        nbytes += r->numel * r->itemsize;
        PyObject *total = PyLong_FromLongLong(nbytes);
        failed = !total || PyObject_SetAttr(self->batch, s_nbytes, total);
        Py_XDECREF(total);
        if (failed || PyDict_SetItem(self->reducer, s_reducer_eps, r->eps)) goto error;
        full = PyList_GET_SIZE(self->tensors) >= r->limit || nbytes >= r->bound;
    }
    if (PyList_Append(r->rows, r->meta) || PyList_Append(r->collective_counts, r->collectives)
        || PyList_Append(r->placement, r->store_index))
        goto error;
    return full;
error:  /* out of memory: the store's count back, as StepBuffer.add puts it back */
    {
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        PyDict_SetItem(self->store, s_count, r->index);
        PyErr_Restore(type, value, traceback);
    }
    return -1;
}

static PyObject *FastRows_add(FastRows *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "add(kind, name, vpp_stage, micro_step, phase, tensor)");
        return NULL;
    }
    RowParts r = {0};
    int ok = read_row(self, args, &r);
    if (ok <= 0) {
        release(&r);
        PyErr_Clear();  /* whatever failed, the Python path meets it again and says so */
        Py_RETURN_FALSE;
    }
    int filled = write_row(self, args[5], &r);
    release(&r);
    if (filled < 0) return NULL;  /* out of memory: the hook's guard says it */
    if (filled) {  /* launched now, as _defer does once the batch is full */
        PyObject *data = owned(self->store, s_data);
        if (!data) return NULL;
        PyObject *flushed = PyObject_CallOneArg(self->flush, data);
        Py_DECREF(data);
        if (!flushed) return NULL;
        Py_DECREF(flushed);
    }
    Py_RETURN_TRUE;
}

/* obj.__dict__ into `slot`, which must hold `keys` (NULL-terminated): the attributes read at every row */
static int take_dict(PyObject *obj, PyObject **slot, const char *what, PyObject **keys[]) {
    Py_XSETREF(*slot, PyObject_GetAttrString(obj, "__dict__"));
    if (!*slot) return -1;
    if (!PyDict_Check(*slot)) {
        PyErr_Format(PyExc_TypeError, "the %s has no __dict__", what);
        return -1;
    }
    for (int i = 0; keys[i]; i++) {
        int found = PyDict_Contains(*slot, *keys[i]);
        if (found <= 0) {
            if (!found)
                PyErr_Format(PyExc_TypeError,
                             "the %s has no attribute %R: trainmon.step._fastrows was built for other code "
                             "(pip install -e . builds it again)",
                             what, *keys[i]);
            return -1;
        }
    }
    return 0;
}

static int take_list(PyObject *batch, const char *name, PyObject **slot, int dict) {
    Py_XSETREF(*slot, PyObject_GetAttrString(batch, name));
    if (!*slot) return -1;
    if (dict ? !PyDict_Check(*slot) : !PyList_Check(*slot)) {
        PyErr_Format(PyExc_TypeError, "the batch's %s has the wrong type", name);
        return -1;
    }
    return 0;
}

static int FastRows_init(FastRows *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"buffer", "store", "reducer", "batch", "module", "codes", "strided",
                               "no_collectives", "device_index", "tensor_type", NULL};
    PyObject *buffer, *store, *reducer, *batch, *module, *codes, *strided, *no_collectives, *tensor_type;
    long device_index;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOO!OOlO!", keywords, &buffer, &store, &reducer, &batch,
                                     &module, &PyDict_Type, &codes, &strided, &no_collectives, &device_index,
                                     &PyType_Type, &tensor_type))
        return -1;
    for (int i = 0; i < N_DESCR; i++) {
        PyObject *d = PyObject_GetAttrString(tensor_type, descr_names[i]);
        if (!d) return -1;
        if (!Py_IS_TYPE(d, &PyGetSetDescr_Type) && !Py_IS_TYPE(d, &PyMethodDescr_Type)) {
            PyErr_Format(PyExc_TypeError, "%s of the tensor type is not torch's own", descr_names[i]);
            Py_DECREF(d);
            return -1;
        }
        Py_XSETREF(self->descr[i], d);
    }
    Py_INCREF(tensor_type);
    Py_XSETREF(self->tensor_type, (PyTypeObject *)tensor_type);
    PyObject **buffer_keys[] = {&s_rows, &s_placement, &s_collectives, &s_rows_seen, &s_shareable,
                                &s_count_collectives, &s_capture, &s_hold, &s_eps, NULL};
    PyObject **store_keys[] = {&s_count, &s_capacity, &s_index, &s_data, NULL};
    PyObject **reducer_keys[] = {&s_learnt, &s_at_hook, &s_batch_bytes, &s_reducer_eps, NULL};
    PyObject **module_keys[] = {&s_unavailable, &s_batch_tensors, NULL};
    if (take_dict(buffer, &self->buffer, "step buffer", buffer_keys)
        || take_dict(store, &self->store, "device store", store_keys)
        || take_dict(reducer, &self->reducer, "reducer", reducer_keys)
        || take_dict(module, &self->module, "reducer's module", module_keys))
        return -1;
    if (!PyObject_HasAttr(batch, s_nbytes)) {
        PyErr_SetString(PyExc_TypeError, "the batch has no nbytes: trainmon.step._fastrows was built for other code");
        return -1;
    }
    Py_XSETREF(self->flush, PyObject_GetAttrString(reducer, "_flush"));
    if (!self->flush) return -1;
    if (take_list(batch, "tensors", &self->tensors, 0) || take_list(batch, "rows", &self->rows, 0)
        || take_list(batch, "versions", &self->versions, 0) || take_list(batch, "addresses", &self->addresses, 0)
        || take_list(batch, "numels", &self->numels, 0) || take_list(batch, "sites", &self->sites, 0)
        || take_list(batch, "codes", &self->tags, 0) || take_list(batch, "by_address", &self->by_address, 1)
        || take_list(batch, "shared_from", &self->shared_from, 0)
        || take_list(batch, "shared_rows", &self->shared_rows, 0))
        return -1;
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(codes, &pos, &key, &value)) {
        if (!PyTuple_Check(value) || PyTuple_GET_SIZE(value) != 2 || !PyLong_Check(PyTuple_GET_ITEM(value, 0))
            || !PyLong_Check(PyTuple_GET_ITEM(value, 1))) {
            PyErr_SetString(PyExc_TypeError, "codes maps a dtype to (tag, itemsize)");
            return -1;
        }
    }
    Py_INCREF(batch); Py_XSETREF(self->batch, batch);
    Py_INCREF(codes); Py_XSETREF(self->codes, codes);
    Py_INCREF(strided); Py_XSETREF(self->strided, strided);
    Py_INCREF(no_collectives); Py_XSETREF(self->no_collectives, no_collectives);
    self->device_index = device_index;
    return 0;
}

/* every object field, listed once for the collector's traversal and for clearing */
#define EACH_OBJECT(DO)                                                                                       \
    DO(buffer) DO(store) DO(reducer) DO(flush) DO(module) DO(codes) DO(strided) DO(no_collectives) DO(batch)  \
    DO(tensors) DO(rows) DO(versions) DO(addresses) DO(numels) DO(sites) DO(tags) DO(by_address)              \
    DO(shared_from) DO(shared_rows) DO(tensor_type)

static int FastRows_traverse(FastRows *self, visitproc visit, void *arg) {
#define VISIT(name) Py_VISIT(self->name);
    EACH_OBJECT(VISIT)
#undef VISIT
    for (int i = 0; i < N_DESCR; i++) Py_VISIT(self->descr[i]);
    return 0;
}

static int FastRows_clear(FastRows *self) {
#define CLEAR(name) Py_CLEAR(self->name);
    EACH_OBJECT(CLEAR)
#undef CLEAR
    for (int i = 0; i < N_DESCR; i++) Py_CLEAR(self->descr[i]);
    return 0;
}

static void FastRows_dealloc(FastRows *self) {
    PyObject_GC_UnTrack(self);
    FastRows_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef FastRows_methods[] = {
    {"add", (PyCFunction)(void (*)(void))FastRows_add, METH_FASTCALL,
     "add(kind, name, vpp_stage, micro_step, phase, tensor) -> bool: StepBuffer.add of a tensor that joins "
     "the Triton batch, done (True) or left to the Python path, with nothing changed (False)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject FastRowsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "trainmon.step._fastrows.FastRows",
    .tp_basicsize = sizeof(FastRows),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "StepBuffer.add's usual case for one device whose reducer batches tensors (Triton).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)FastRows_init,
    .tp_dealloc = (destructor)FastRows_dealloc,
    .tp_traverse = (traverseproc)FastRows_traverse,
    .tp_clear = (inquiry)FastRows_clear,
    .tp_methods = FastRows_methods,
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "trainmon.step._fastrows",
    "The step buffer's hot path in C (see FastRows).", -1, NULL,
};

PyMODINIT_FUNC PyInit__fastrows(void) {
    if (intern_all() < 0) return NULL;
    if (PyType_Ready(&FastRowsType) < 0) return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (!module) return NULL;
    Py_INCREF(&FastRowsType);
    if (PyModule_AddObject(module, "FastRows", (PyObject *)&FastRowsType) < 0) {
        Py_DECREF(&FastRowsType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
